#!/usr/bin/env python3
"""Train kvq's embedded default model, kvq-code-tiny, from scratch.

A small Qwen3-architecture causal LM (GQA, alternating sliding-window and
full-attention layers, head_dim 64) with a byte-level BPE tokenizer, trained on
the Python standard library sources of the machine it runs on. It exists so
that kvq has a real, committed, license-clean model whose architecture
exercises per-layer KV-cache choices (sliding vs full layers) in tests and
demos.

Runs on a GPU machine with torch, transformers and tokenizers. The data part
needs only the standard library: `--data-only` prints the split statistics and
exits (useful on a machine without torch).

Example (the command used for the committed model is recorded in
models/kvq-code-tiny/README.md):
    python3 tools/train_default_model.py --out models/kvq-code-tiny --minutes 4.5
Smoke test (seconds):
    python3 tools/train_default_model.py --out /tmp/smoke --steps 20 --max-files 60
"""

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import sysconfig
import time

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BOS = "<|endoftext|>"

# ChatML, no system prompt injected; the server issue renders chats with it.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

PROMPTS = [
    "def fibonacci(n):",
    "import os\n\ndef ",
    "class Stack:\n    def __init__(self):",
    "for i in range(10):\n    ",
    "def read_lines(path):\n    \"\"\"Return the lines of the file at *path*.\"\"\"\n",
]
SAMPLE_PROMPTS = [PROMPTS[0], PROMPTS[2]]

# Directory names never used as training text: tests (the brief excludes them,
# they are also huge and repetitive), third-party packages, and byte caches.
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
MAX_FILE_BYTES = 400_000  # skips generated blobs such as pydoc_data/topics.py
GENERATED_MARK = "with gencodec.py"  # encodings/cp*.py etc.: generated 256-entry tables, not code


def collect_files(root, max_files=None):
    """Returns [(relative path, text)] of the stdlib's *.py files, sorted by path."""
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        parts = [] if rel_dir == "." else rel_dir.split(os.sep)
        if any(p in SKIP_DIRS for p in parts):
            dirnames[:] = []
            continue
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                paths.append(os.path.join(rel_dir, name) if parts else name)
    paths.sort()
    files = []
    for rel in paths:
        full = os.path.join(root, rel)
        try:
            if os.path.getsize(full) > MAX_FILE_BYTES:
                continue
            with open(full, "rb") as f:
                text = f.read().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip() and GENERATED_MARK not in text[:600]:
            files.append((rel, text))
        if max_files and len(files) >= max_files:
            break
    return files


def split_files(files):
    """Deterministic split by position in the sorted list: every 20th file is
    held out for the reported perplexity, another 20th is validation (used only
    to pick the checkpoint), the rest is training text."""
    heldout = [f for i, f in enumerate(files) if i % 20 == 0]
    val = [f for i, f in enumerate(files) if i % 20 == 10]
    train = [f for i, f in enumerate(files) if i % 20 not in (0, 10)]
    return train, val, heldout


def heldout_sample(heldout, target_bytes):
    """Held-out files concatenated up to about target_bytes, cut at a line end."""
    out = []
    size = 0
    for _, text in heldout:
        if not text.endswith("\n"):
            text += "\n"
        out.append(text)
        size += len(text.encode("utf-8"))
        if size >= target_bytes:
            break
    joined = "".join(out)
    data = joined.encode("utf-8")
    if len(data) > target_bytes:
        cut = data.rfind(b"\n", 0, target_bytes)
        data = data[: cut + 1] if cut > 0 else data[:target_bytes]
        joined = data.decode("utf-8", errors="ignore")
    return joined


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def make_qwen3_config(transformers, **kw):
    """Builds a Qwen3Config across transformers versions: v5 takes
    rope_parameters, v4 takes rope_theta. Sets rope_parameters afterwards if the
    constructor left it empty (seen in some v5 builds when layer_types is
    given explicitly)."""
    rope_theta = kw.pop("rope_theta")
    rope = {"rope_type": "default", "rope_theta": float(rope_theta)}
    try:
        cfg = transformers.Qwen3Config(rope_parameters=dict(rope), **kw)
    except TypeError as e:
        print(f"[config] rope_parameters not accepted ({e}); using rope_theta")
        cfg = transformers.Qwen3Config(rope_theta=float(rope_theta), **kw)
    if hasattr(cfg, "rope_parameters"):
        rp = getattr(cfg, "rope_parameters", None)
        if not isinstance(rp, dict) or "rope_theta" not in rp:
            print(f"[config] rope_parameters was {rp!r}; setting it explicitly")
            cfg.rope_parameters = dict(rope)
    if list(cfg.layer_types or []) != list(kw["layer_types"]):
        print(f"[config] layer_types came back as {cfg.layer_types}; setting explicitly")
        cfg.layer_types = list(kw["layer_types"])
    return cfg


def check_sliding_layers(model, cfg):
    """Fails loudly unless every sliding layer really carries its window."""
    ok = True
    for i, layer in enumerate(model.model.layers):
        sw = getattr(layer.self_attn, "sliding_window", "missing")
        want = cfg.sliding_window if cfg.layer_types[i] == "sliding_attention" else None
        print(f"[check] layer {i}: {cfg.layer_types[i]:18s} self_attn.sliding_window={sw}")
        ok &= sw == want
    print(f"[check] has_sliding_layers={getattr(model.model, 'has_sliding_layers', 'n/a')}")
    if not ok:
        raise SystemExit("sliding_window per layer does not follow layer_types")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models/kvq-code-tiny")
    ap.add_argument("--minutes", type=float, default=4.5, help="training wall-clock budget")
    ap.add_argument("--steps", type=int, default=0, help="fixed step count (overrides --epochs)")
    ap.add_argument("--epochs", type=float, default=20.0,
                    help="planned passes over the training tokens; the lr schedule spans them")
    ap.add_argument("--max-files", type=int, default=0, help="use only the first N files (smoke tests)")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--sliding-window", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=150)
    ap.add_argument("--patience", type=int, default=6, help="evals without validation gain before stopping")
    ap.add_argument("--heldout-bytes", type=int, default=200_000)
    ap.add_argument("--sample-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--data-only", action="store_true")
    ap.add_argument("--readme-out", default=None, help="--out value shown in the README's command line")
    ap.add_argument("--note", default="", help="sentence added to the README's training section")
    args = ap.parse_args()
    t_start = time.time()

    stdlib = sysconfig.get_paths()["stdlib"]
    files = collect_files(stdlib, args.max_files or None)
    train_files, val_files, heldout_files = split_files(files)
    nbytes = lambda fs: sum(len(t.encode("utf-8")) for _, t in fs)
    print(f"[data] stdlib={stdlib} python={sys.version.split()[0]} files={len(files)} "
          f"train={len(train_files)} ({nbytes(train_files)/1e6:.2f} MB) val={len(val_files)} "
          f"({nbytes(val_files)/1e6:.2f} MB) heldout={len(heldout_files)} ({nbytes(heldout_files)/1e6:.2f} MB)")
    heldout_text = heldout_sample(heldout_files, args.heldout_bytes)
    print(f"[data] heldout.txt: {len(heldout_text.encode('utf-8'))} bytes")
    if args.data_only:
        print("[data] first heldout files:", [p for p, _ in heldout_files[:5]])
        return

    import torch
    import torch.nn.functional as F
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    print(f"[env] torch={torch.__version__} transformers={transformers.__version__} "
          f"tokenizers={tokenizers.__version__} cuda={torch.cuda.is_available()}")
    torch.manual_seed(args.seed)
    out = args.out
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "heldout.txt"), "w", encoding="utf-8", newline="") as f:
        f.write(heldout_text)
    with open(os.path.join(out, "prompts.txt"), "w", encoding="utf-8") as f:
        for p in PROMPTS:
            f.write(json.dumps(p, ensure_ascii=False) + "\n")
    lic = os.path.join(stdlib, "LICENSE.txt")
    if os.path.exists(lic):
        shutil.copyfile(os.path.realpath(lic), os.path.join(out, "LICENSE-PSF.txt"))
    else:
        print(f"[data] no {lic}; LICENSE-PSF.txt not written")

    # ---- tokenizer ----
    t0 = time.time()
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((t for _, t in train_files), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    assert [tok.token_to_id(s) for s in SPECIAL_TOKENS] == [0, 1, 2], "special token ids"
    # BOS is prepended by encode(add_special_tokens=True): training documents
    # start with it, so prompts must too.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    vocab_size = tok.get_vocab_size()
    print(f"[tok] trained vocab={vocab_size} in {time.time()-t0:.1f}s")

    from transformers import PreTrainedTokenizerFast
    fast_kw = dict(tokenizer_object=tok, bos_token=BOS, eos_token=BOS, model_max_length=2048,
                   clean_up_tokenization_spaces=False)
    try:
        fast = PreTrainedTokenizerFast(additional_special_tokens=SPECIAL_TOKENS[1:], **fast_kw)
    except (TypeError, ValueError) as e:
        print(f"[tok] additional_special_tokens rejected ({e}); retrying without")
        fast = PreTrainedTokenizerFast(**fast_kw)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    # The raw tokenizer the model is trained with is the source of truth.
    tok.save(os.path.join(out, "tokenizer.json"))
    tc_path = os.path.join(out, "tokenizer_config.json")
    with open(tc_path, encoding="utf-8") as f:
        tc = json.load(f)
    tc["chat_template"] = CHAT_TEMPLATE
    tc["bos_token"] = BOS
    tc["eos_token"] = BOS
    with open(tc_path, "w", encoding="utf-8") as f:
        json.dump(tc, f, indent=2, ensure_ascii=False)
        f.write("\n")
    jinja = os.path.join(out, "chat_template.jinja")
    if os.path.exists(jinja):
        os.remove(jinja)  # one source of truth: tokenizer_config.json

    # ---- data to ids ----
    t0 = time.time()

    def stream(fs):
        encs = tok.encode_batch([t for _, t in fs], add_special_tokens=False)
        ids = []
        for e in encs:
            ids.append(bos_id)
            ids.extend(e.ids)
        return torch.tensor(ids, dtype=torch.long)

    train_ids, val_ids = stream(train_files), stream(val_files)
    heldout_ids = tok.encode(heldout_text, add_special_tokens=True).ids
    print(f"[data] tokens: train={train_ids.numel()} val={val_ids.numel()} heldout.txt={len(heldout_ids)} "
          f"({nbytes(train_files)/max(1,train_ids.numel()):.2f} bytes/token) in {time.time()-t0:.1f}s")

    # ---- model ----
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(args.layers)]
    cfg = make_qwen3_config(
        transformers, vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim, hidden_act="silu", max_position_embeddings=2048, initializer_range=0.02,
        rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False, use_sliding_window=True,
        sliding_window=args.sliding_window, layer_types=layer_types, rope_theta=10000.0,
        bos_token_id=bos_id, eos_token_id=bos_id)
    model = transformers.Qwen3ForCausalLM(cfg)
    print("[config]", model.config)
    check_sliding_layers(model, model.config)
    inv = model.model.rotary_emb.inv_freq.float()
    want = 10000.0 ** (-torch.arange(0, args.head_dim, 2, dtype=torch.float64) / args.head_dim)
    assert torch.allclose(inv.double().cpu(), want, rtol=1e-5), "RoPE inv_freq is not theta=10000"
    nparams = sum(p.numel() for p in model.parameters())
    print(f"[model] parameters={nparams} ({nparams*2/1e6:.2f} MB in bf16), attn={model.config._attn_implementation}")

    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    model.to(dev).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
    T, B, V = args.seq_len, args.batch, vocab_size
    train_gpu = train_ids.to(dev)
    span = torch.arange(T + 1, device=dev)
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)

    def windows(ids, n):
        """Up to n fixed windows spread evenly over the whole stream."""
        k = min(n, (ids.numel() - 1) // (T + 1))
        assert k > 0, "too little text for one window (use more files)"
        stride = (ids.numel() - T - 1) // k
        return torch.stack([ids[i * stride:i * stride + T + 1] for i in range(k)]).to(dev)

    val_w = windows(val_ids, 128)
    # Fixed training windows, evaluated like validation, so both losses are comparable.
    train_w = windows(train_ids, 128)

    @torch.no_grad()
    def eval_loss(w):
        model.eval()
        tot, cnt = 0.0, 0
        for i in range(0, w.shape[0], 32):
            chunk = w[i:i + 32]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=chunk[:, :-1], use_cache=False).logits
            tot += F.cross_entropy(logits.float().reshape(-1, V), chunk[:, 1:].reshape(-1), reduction="sum").item()
            cnt += chunk[:, 1:].numel()
        model.train()
        return tot / cnt

    budget = args.minutes * 60.0
    planned = args.steps or math.ceil(args.epochs * train_ids.numel() / (B * T))
    warmup = min(args.warmup, max(1, planned // 10))
    print(f"[train] planned steps {planned} ({planned*B*T/train_ids.numel():.1f} epochs), time cap {budget:.0f}s")
    best = (float("inf"), 0, None)
    bad_evals = 0
    step = 0
    log_loss = torch.zeros((), device=dev)
    last_train_loss = float("nan")
    history = []
    t_train = time.time()
    torch.cuda.synchronize()
    while True:
        elapsed = time.time() - t_train
        if step >= planned or elapsed >= budget:
            break
        # The schedule follows whichever budget (steps or time) runs out first.
        progress = max(step / planned, elapsed / budget)
        if step < warmup:
            lr = args.lr * (step + 1) / warmup
        else:
            lr = args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
        for g in opt.param_groups:
            g["lr"] = lr
        ix = torch.randint(0, train_gpu.numel() - T - 1, (B,), device=dev, generator=gen)
        chunk = train_gpu[ix[:, None] + span[None, :]]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=chunk[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.float().reshape(-1, V), chunk[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        log_loss += loss.detach()
        if step % args.log_every == 0:
            last_train_loss = (log_loss / args.log_every).item()
            log_loss.zero_()
            el = time.time() - t_train
            print(f"[train] step {step} loss {last_train_loss:.4f} lr {lr:.2e} elapsed {el:.1f}s "
                  f"tok/s {step*B*T/el:.3g}")
        if step % args.eval_every == 0:
            vl, tl = eval_loss(val_w), eval_loss(train_w)
            history.append((step, tl, vl))
            mark = ""
            if vl < best[0]:
                best = (vl, step, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
                bad_evals = 0
                mark = " *best"
            else:
                bad_evals += 1
            print(f"[eval] step {step} train_loss {tl:.4f} val_loss {vl:.4f} val_ppl {math.exp(vl):.3f}{mark}")
            if bad_evals >= args.patience:
                print(f"[train] early stop: no validation gain in {args.patience} evals")
                break
    torch.cuda.synchronize()
    train_time = time.time() - t_train
    final_vl, final_tl = eval_loss(val_w), eval_loss(train_w)
    history.append((step, final_tl, final_vl))
    if final_vl < best[0] or best[2] is None:
        best = (final_vl, step, None)
    else:
        model.load_state_dict(best[2])
    best_vl, best_step = best[0], best[1]
    best_tl = [h[1] for h in history if h[0] == best_step][-1]
    print(f"[train] done: steps={step} time={train_time:.1f}s tokens_seen={step*B*T} "
          f"kept step {best_step}: train_loss {best_tl:.4f} val_loss {best_vl:.4f}")

    # ---- save (bf16) ----
    del opt
    model.to(torch.bfloat16)
    model.config.use_cache = True
    try:
        model.save_pretrained(out, safe_serialization=True)
    except TypeError:
        model.save_pretrained(out)
    summary = {"steps": step, "train_seconds": round(train_time, 1), "tokens_seen": step * B * T,
               "train_tokens": int(train_ids.numel()), "kept_step": best_step,
               "kept_train_loss": best_tl, "best_val_loss": best_vl, "epochs_planned": args.epochs,
               "history": history}
    with open(os.path.join(out, "train_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    gcfg = transformers.GenerationConfig(bos_token_id=bos_id, eos_token_id=[bos_id, 2], do_sample=False)
    gcfg.save_pretrained(out)
    assert os.path.exists(os.path.join(out, "model.safetensors")), "model.safetensors not written"

    # ---- everything below evaluates the saved folder as others will load it ----
    # (model.to(bf16) also rounded the in-memory RoPE inv_freq buffer; a fresh load recomputes it in fp32)
    del model
    torch.cuda.empty_cache()
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16).to(dev).eval()
    check_sliding_layers(model, model.config)
    print(f"[check] reloaded: weights {model.model.embed_tokens.weight.dtype}, "
          f"rotary inv_freq {model.model.rotary_emb.inv_freq.dtype}, attn {model.config._attn_implementation}")

    @torch.no_grad()
    def heldout_nll(fp32):
        ids = torch.tensor(heldout_ids, dtype=torch.long)
        n = ids.numel() // T
        w = ids[: n * T].view(n, T).to(dev)
        tot, cnt = 0.0, 0
        head = model.get_output_embeddings().weight.float()
        for i in range(0, n, 16):
            x = w[i:i + 16]
            if fp32:
                logits = model(input_ids=x, use_cache=False).logits.float()
            else:
                h = model.model(input_ids=x, use_cache=False).last_hidden_state
                logits = h.float() @ head.t()
            tot += F.cross_entropy(logits[:, :-1].reshape(-1, V), x[:, 1:].reshape(-1), reduction="sum").item()
            cnt += x[:, 1:].numel()
        return tot / cnt, n, cnt

    nll_bf16, nwin, nscored = heldout_nll(False)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(dev).eval()
    nll_fp32, _, _ = heldout_nll(True)
    print(f"[heldout] windows={nwin}x{T} scored={nscored} ppl_bf16={math.exp(nll_bf16):.4f} "
          f"ppl_fp32={math.exp(nll_fp32):.4f}")
    evalj = {
        "file": "heldout.txt",
        "protocol": ("ids = tokenizer.encode(text, add_special_tokens=True) (one BOS at the start); "
                     f"consecutive non-overlapping windows of {T} tokens, last partial window dropped; "
                     "each window run on its own from position 0; every token after a window's first is scored"),
        "ctx": T, "windows": nwin, "tokens_scored": nscored,
        "bf16_weights_fp32_logits": {"nll": nll_bf16, "ppl": math.exp(nll_bf16)},
        "fp32": {"nll": nll_fp32, "ppl": math.exp(nll_fp32)},
        "torch": torch.__version__, "transformers": transformers.__version__,
    }
    with open(os.path.join(out, "heldout_eval.json"), "w") as f:
        json.dump(evalj, f, indent=2)
        f.write("\n")

    # ---- greedy samples (fp32, full recompute each step, no EOS stop) ----
    @torch.no_grad()
    def greedy(prompt, n):
        ids = tok.encode(prompt, add_special_tokens=True).ids
        x = torch.tensor([ids], device=dev)
        for _ in range(n):
            nxt = model(input_ids=x, use_cache=False).logits[0, -1].argmax()
            x = torch.cat([x, nxt.view(1, 1)], dim=1)
        return tok.decode(x[0].tolist(), skip_special_tokens=True)

    samples = []
    for p in SAMPLE_PROMPTS:
        text = greedy(p, args.sample_tokens)
        samples.append((p, text))
        print(f"[sample] prompt {p!r} ->\n{text}\n[sample] ----")

    # ---- consistency checks of the saved folder ----
    checks = []
    try:
        auto_tok = transformers.AutoTokenizer.from_pretrained(out)
        raw = tokenizers.Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
        probe = [heldout_text[:3000], "def f(x):\n\treturn x  # ü 🐍\r\n", "<|im_start|>user\nhi<|im_end|>\n"]
        same = all(auto_tok(s)["input_ids"] == raw.encode(s).ids == tok.encode(s).ids for s in probe)
        checks.append(f"AutoTokenizer == tokenizers == training tokenizer on probes: {same}")
        chat = auto_tok.apply_chat_template([{"role": "user", "content": "Write a stack."}],
                                            tokenize=False, add_generation_prompt=True)
        checks.append(f"chat template renders: {chat!r}")
        checks.append(f"reloaded layer_types={model.config.layer_types}; sliding_window={model.config.sliding_window}")
    except Exception as e:  # report, do not lose the trained model over a check
        checks.append(f"CHECK FAILED: {type(e).__name__}: {e}")
    for c in checks:
        print("[check]", c)

    # ---- README ----
    files_info = []
    for name in sorted(os.listdir(out)):
        if name == "README.md":
            continue
        pth = os.path.join(out, name)
        files_info.append(f"    {sha256_file(pth)}  {name} ({os.path.getsize(pth):,} bytes)")
    cfgd = model.config
    argv = list(sys.argv[1:])
    if args.readme_out and "--out" in argv:
        argv[argv.index("--out") + 1] = args.readme_out
    shown = [a for a in argv]
    for flag in ("--readme-out", "--note"):
        if flag in shown:
            i = shown.index(flag)
            del shown[i:i + 2]
    cmd = "python3 tools/train_default_model.py " + " ".join(json.dumps(a) if " " in a else a for a in shown)
    hist = "\n".join(f"    step {s:6d}  train {tl:.4f}  val {vl:.4f}" for s, tl, vl in history)
    sample_md = "\n\n".join(f"Prompt `{json.dumps(p)}` (BOS + prompt, 128 greedy tokens, fp32):\n\n```python\n{t}\n```"
                            for p, t in samples)
    gpu = torch.cuda.get_device_name(0)
    readme = f"""# kvq-code-tiny: kvq's embedded default model

A small causal language model of Python code, trained from scratch by
`tools/train_default_model.py` on the Python standard library sources. It is
kvq's built-in default model: tiny enough to commit ({nparams:,} parameters,
bf16 safetensors), real enough that greedy output is recognisable Python, and
shaped to exercise per-layer KV-cache choices: grouped-query attention
(4 query heads, 2 KV heads, head_dim 64) and alternating sliding-window /
full-attention layers.

## Architecture (Hugging Face `Qwen3ForCausalLM`, config.json)

- hidden {cfgd.hidden_size}, {cfgd.num_hidden_layers} layers, intermediate {cfgd.intermediate_size}, SiLU-gated MLP,
  RMSNorm eps {cfgd.rms_norm_eps}, no biases, Qwen3's per-head RMSNorm on q and k (`q_norm`, `k_norm`) before RoPE.
- attention: {cfgd.num_attention_heads} query heads, {cfgd.num_key_value_heads} KV heads, head_dim {cfgd.head_dim};
  RoPE theta 10000 (rotate_half convention), max_position_embeddings {cfgd.max_position_embeddings}
  (trained on sequences of {T} tokens only).
- `layer_types` = {list(cfgd.layer_types)}; sliding layers use `sliding_window` = {cfgd.sliding_window}
  (Hugging Face semantics: the query at position q attends keys at positions q-{cfgd.sliding_window}+1 .. q).
  `layer_types` is authoritative; `max_window_layers` is ignored when it is present.
- vocab {vocab_size}, embeddings tied to the output head (no `lm_head.weight` in the file).
- tokenizer: byte-level BPE (`tokenizers`), ByteLevel pre-tokenizer (add_prefix_space false, GPT-2 regex),
  ByteLevel decoder, no normalizer. Special tokens: `<|endoftext|>`=0 (BOS, EOS, document separator),
  `<|im_start|>`=1, `<|im_end|>`=2. `encode(..., add_special_tokens=True)` prepends BOS (post-processor);
  ChatML `chat_template` in tokenizer_config.json. generation_config.json: eos [0, 2], greedy.

## Training

- Command: `{cmd}`
- Data: `*.py` under `sysconfig.get_paths()['stdlib']` = `{stdlib}` (CPython {sys.version.split()[0]}), excluding
  test/tests/idle_test/site-packages folders, files over {MAX_FILE_BYTES:,} bytes and the generated codec tables
  (files marked "{GENERATED_MARK}"); sorted by path; file i
  with i % 20 == 0 held out (evaluation), i % 20 == 10 validation (checkpoint choice), the rest training:
  {len(train_files)} files / {nbytes(train_files):,} bytes / {train_ids.numel():,} tokens for training. Each document is
  `<|endoftext|>` + its tokens; training windows of {T}+1 tokens are drawn at random offsets of the concatenation.
- AdamW (betas 0.9/0.95, weight decay {args.weight_decay} on matrices), peak lr {args.lr}, {warmup} warm-up steps, cosine
  to {args.min_lr_frac} x peak over {planned} planned steps ({planned*B*T/train_ids.numel():.1f} epochs; time cap {budget:.0f} s), grad clip 1.0, bf16 autocast, batch {B} x {T} tokens,
  validation every {args.eval_every} steps, best validation checkpoint kept, early stop after {args.patience} evals without gain.
  {args.note}
- Hardware: {gpu}; torch {torch.__version__}, transformers {transformers.__version__}, tokenizers {tokenizers.__version__}.
- Training loop wall time {train_time:.1f} s, {step} steps, {step*B*T:,} tokens seen; kept checkpoint: step {best_step},
  train loss {best_tl:.4f}, validation loss {best_vl:.4f} (last logged running train loss {last_train_loss:.4f}).
  Whole script wall time: see the log; everything before the loop took {t_train - t_start:.0f} s.

Loss history (mean token cross-entropy, nats, on up to 128 fixed windows spread over each set):

{hist}

## Held-out perplexity

On `heldout.txt` ({len(heldout_text.encode('utf-8')):,} bytes of held-out standard-library files, {len(heldout_ids):,} tokens):
{evalj['protocol']}. {nwin} windows, {nscored:,} tokens scored.

Measured on the saved files, reloaded with `AutoModelForCausalLM.from_pretrained`.

- bf16 weights, fp32 logits: **ppl {math.exp(nll_bf16):.4f}** (nll {nll_bf16:.5f})
- fp32 (weights upcast, TF32 off): **ppl {math.exp(nll_fp32):.4f}** (nll {nll_fp32:.5f})

Also in `heldout_eval.json`. `prompts.txt` holds code prompts, one JSON string per line.

## Greedy samples

{sample_md}

## License and origin

Trained from scratch (random initialisation) by this repository's script; no pretrained weights were used.
The training text is the Python standard library from CPython, copyright Python Software Foundation, under
the PSF License Agreement (text copied from the training machine's Python into `LICENSE-PSF.txt` where it
was present; also at https://docs.python.org/3/license.html). `heldout.txt` contains verbatim excerpts of
those files under that license.

## Files (sha256)

{chr(10).join(files_info)}
"""
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8") as f:
        f.write(readme)
    total = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
    print(f"[done] {out}: {total/1e6:.2f} MB, script wall time {time.time()-t_start:.1f}s")


if __name__ == "__main__":
    main()
