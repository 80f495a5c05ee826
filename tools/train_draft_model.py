#!/usr/bin/env python3
"""Train kvq-code-tiny-draft: a small draft model for speculative decoding with
kvq's default model, models/kvq-code-tiny, as the target.

The draft is a Hugging Face Qwen3ForCausalLM with the target's tokenizer,
vocabulary, hidden size, head layout (4 query / 2 KV heads, head_dim 64) and
tied embeddings, but only 1 or 2 decoder layers, all full attention. It is
distilled from the target on the target's own training text (the CPython
standard library, split exactly as tools/train_default_model.py splits it):
the loss is KL(target softmax || draft softmax) over the target's logits on
random training windows (optionally plus a share of next-token
cross-entropy). The embedding (and so the tied output head) starts as the
target's and stays frozen unless --train-embed; with --init target the draft's
decoder layers and final norm start as copies of target layers (first, and
last for a 2-layer draft).

Each depth in --layers is trained with the same seed and budget; the depth kept
is the one with the best estimated speedup on the validation split (greedy
acceptance measured in PyTorch, draft cost taken as draft layers / target
layers per forward). The kept model is saved in bf16, reloaded from disk and
measured on models/kvq-code-tiny/heldout.txt: greedy speculative acceptance
for k = 2, 4, 8 drafts per step, top-1 agreement with the target, and a
speculative greedy generation that must reproduce the target's own greedy
output.

Runs on a GPU machine with torch, transformers, tokenizers and safetensors.
    python3 tools/train_draft_model.py --out models/kvq-code-tiny-draft
Smoke test (seconds):
    python3 tools/train_draft_model.py --smoke --out /tmp/smoke/kvq-code-tiny-draft
"""

import argparse
import copy
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import sysconfig
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_default_model as tdm  # noqa: E402  data collection and split shared with the target

FROM_TARGET = ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
HELDOUT_BYTES = 200_000  # what train_default_model.py's --heldout-bytes default cut heldout.txt to


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def draft_config_dict(target_cfg, layers):
    """The target's config.json (same fields, same order) with the draft's depth
    and full attention in every layer."""
    d = copy.deepcopy(target_cfg)
    d["num_hidden_layers"] = layers
    d["layer_types"] = ["full_attention"] * layers
    d["use_sliding_window"] = False
    d["sliding_window"] = None
    return d


def target_layer_picks(n_draft, n_target):
    """Target layers whose weights initialise the draft's: evenly spaced from the
    first to the last (1 layer: [0]; 2 layers: [0, n_target-1])."""
    if n_draft == 1:
        return [0]
    return [round(i * (n_target - 1) / (n_draft - 1)) for i in range(n_draft)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="models/kvq-code-tiny")
    ap.add_argument("--out", default="models/kvq-code-tiny-draft")
    ap.add_argument("--layers", default="1,2", help="comma-separated draft depths to train; the best is kept")
    ap.add_argument("--steps", type=int, default=1200, help="planned steps per depth (the lr schedule spans them)")
    ap.add_argument("--seconds", type=float, default=50.0, help="training wall-clock cap per depth")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--ce-weight", type=float, default=0.0,
                    help="weight of next-token cross-entropy added to the KL distillation loss")
    ap.add_argument("--train-embed", action="store_true", help="train the (tied) embedding too")
    ap.add_argument("--init", choices=["target", "random"], default="target",
                    help="decoder layers and final norm: copies of target layers, or random")
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--positions", type=int, default=256, help="random positions for the acceptance test")
    ap.add_argument("--ks", default="2,4,8", help="drafts per step measured")
    ap.add_argument("--gen-tokens", type=int, default=64, help="tokens per prompt in the generation check")
    ap.add_argument("--max-files", type=int, default=0, help="use only the first N stdlib files (smoke tests)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--smoke", action="store_true", help="a few steps of everything (seconds)")
    args = ap.parse_args()
    if args.smoke:
        args.max_files = args.max_files or 40
        args.steps, args.seconds, args.eval_every, args.log_every = 6, 15.0, 3, 2
        args.positions, args.gen_tokens, args.warmup = 16, 8, 2
    t_start = time.time()
    ks = sorted({int(k) for k in args.ks.split(",")})
    kmax = ks[-1]
    depths = [int(x) for x in args.layers.split(",")]

    # ---- data: the target's files and split ----
    stdlib = sysconfig.get_paths()["stdlib"]
    files = tdm.collect_files(stdlib, args.max_files or None)
    train_files, val_files, heldout_files = tdm.split_files(files)
    nbytes = lambda fs: sum(len(t.encode("utf-8")) for _, t in fs)
    with open(os.path.join(args.target, "heldout.txt"), encoding="utf-8", newline="") as f:
        heldout_text = f.read()
    same_split = tdm.heldout_sample(heldout_files, HELDOUT_BYTES) == heldout_text
    print(f"[data] stdlib={stdlib} python={sys.version.split()[0]} files={len(files)} "
          f"train={len(train_files)} ({nbytes(train_files)/1e6:.2f} MB) val={len(val_files)} "
          f"heldout={len(heldout_files)}; target heldout.txt reproduced by this split: {same_split}")

    import torch
    import torch.nn.functional as F
    import tokenizers
    import transformers
    import safetensors
    from safetensors import safe_open

    print(f"[env] torch={torch.__version__} transformers={transformers.__version__} "
          f"tokenizers={tokenizers.__version__} safetensors={safetensors.__version__} cuda={torch.cuda.is_available()}")
    dev = torch.device("cuda")
    torch.manual_seed(args.seed)

    tok = tokenizers.Tokenizer.from_file(os.path.join(args.target, "tokenizer.json"))
    bos_id = tok.token_to_id(tdm.BOS)
    assert [tok.token_to_id(s) for s in tdm.SPECIAL_TOKENS] == [0, 1, 2], "special token ids"
    V = tok.get_vocab_size()

    def stream(fs):  # as train_default_model.py: each document is BOS + its tokens
        encs = tok.encode_batch([t for _, t in fs], add_special_tokens=False)
        ids = []
        for e in encs:
            ids.append(bos_id)
            ids.extend(e.ids)
        return torch.tensor(ids, dtype=torch.long)

    train_ids, val_ids = stream(train_files), stream(val_files)
    heldout_ids = torch.tensor(tok.encode(heldout_text, add_special_tokens=True).ids, dtype=torch.long)
    print(f"[data] tokens: train={train_ids.numel()} val={val_ids.numel()} heldout.txt={heldout_ids.numel()}")

    # ---- target ----
    with open(os.path.join(args.target, "config.json")) as f:
        tcfg = json.load(f)
    assert tcfg["vocab_size"] == V, "tokenizer and target config disagree on the vocabulary"
    target = transformers.AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).to(dev).eval()
    target.requires_grad_(False)
    n_target_layers = tcfg["num_hidden_layers"]

    T, B = args.seq_len, args.batch
    ctx = T - kmax  # acceptance contexts: context + kmax drafts = T tokens, the training length
    train_gpu = train_ids.to(dev)
    span = torch.arange(T + 1, device=dev)

    def windows(ids, n):
        """Up to n fixed windows of T+1 tokens spread evenly over ids."""
        k = min(n, (ids.numel() - 1) // (T + 1))
        assert k > 0, "too little text for one window"
        stride = (ids.numel() - T - 1) // k
        return torch.stack([ids[i * stride:i * stride + T + 1] for i in range(k)]).to(dev)

    val_w = windows(val_ids, 64)
    n_held = (heldout_ids.numel() - 1) // (T + 1)
    held_w = heldout_ids[: n_held * (T + 1)].view(n_held, T + 1).to(dev)  # consecutive, non-overlapping

    @torch.no_grad()
    def teacher_forced(model, w, autocast):
        """Over windows w: mean KL(target || draft) per token, top-1 agreement of
        draft and target argmax, and the draft's cross-entropy on the real next token."""
        was_training = model.training
        model.eval()
        kl = agree = ce = cnt = 0.0
        for i in range(0, w.shape[0], 32):
            x, y = w[i:i + 32, :-1], w[i:i + 32, 1:]
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                tl = target(input_ids=x, use_cache=False).logits
                dl = model(input_ids=x, use_cache=False).logits
            tlp = F.log_softmax(tl.float(), -1)
            dlp = F.log_softmax(dl.float(), -1)
            kl += (tlp.exp() * (tlp - dlp)).sum().item()
            agree += (tlp.argmax(-1) == dlp.argmax(-1)).sum().item()
            ce += F.nll_loss(dlp.reshape(-1, V), y.reshape(-1), reduction="sum").item()
            cnt += x.numel()
        model.train(was_training)
        return {"kl": kl / cnt, "top1_agree": agree / cnt, "draft_ce": ce / cnt, "tokens": int(cnt)}

    @torch.no_grad()
    def acceptance(model, ids, n_pos, seed):
        """Greedy speculative acceptance at n_pos random positions p of ids.
        Context = the ctx tokens before p. The draft proposes kmax tokens greedily;
        the target scores context + drafts in one forward; accepted = length of the
        longest draft prefix equal to the target's argmax. Greedy drafts for k < kmax
        are prefixes of those for kmax, so accepted(k) = min(accepted(kmax), k)."""
        model.eval()
        g = torch.Generator().manual_seed(seed)
        pos = torch.randint(ctx, ids.numel() + 1, (n_pos,), generator=g).tolist()
        acc = []
        for i in range(0, n_pos, 64):
            cur = torch.stack([ids[p - ctx:p] for p in pos[i:i + 64]]).to(dev)
            for _ in range(kmax):
                nxt = model(input_ids=cur, use_cache=False, logits_to_keep=1).logits[:, -1].argmax(-1)
                cur = torch.cat([cur, nxt[:, None]], 1)
            t = target(input_ids=cur, use_cache=False, logits_to_keep=kmax + 1).logits.argmax(-1)
            match = (cur[:, ctx:] == t[:, :kmax]).int()
            acc.append(match.cumprod(1).sum(1).cpu())
        acc = torch.cat(acc)
        res = {}
        for k in ks:
            a = acc.clamp(max=k).float()
            res[str(k)] = {"mean_accepted": a.mean().item(), "tokens_per_step": (a + 1).mean().item(),
                           "all_accepted_rate": (acc >= k).float().mean().item()}
        return res

    def matrix_params(m):
        """Weights a decode forward reads: every matrix once (the tied embedding once, as the head)."""
        return sum(p.numel() for p in m.parameters() if p.dim() >= 2)

    target_matrix_params = matrix_params(target)

    def est_speedup(res, cost):
        """tokens per verify step / (1 + k * cost), cost = a draft forward over a target forward (a proxy)."""
        return {k: r["tokens_per_step"] / (1 + int(k) * cost) for k, r in res.items()}

    def round_to_bf16(model):
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())

    cfg_dir = os.path.join("/tmp", f"kvq_draft_cfg_{os.getpid()}")

    # ---- train one depth ----
    def train_depth(L):
        torch.manual_seed(args.seed)
        d = os.path.join(cfg_dir, f"L{L}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(draft_config_dict(tcfg, L), f, indent=2)
        cfg = transformers.AutoConfig.from_pretrained(d)
        model = transformers.Qwen3ForCausalLM(cfg).float()
        if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
            print("[model] lm_head was not tied; tying it to embed_tokens")
            model.lm_head.weight = model.model.embed_tokens.weight
        picks = target_layer_picks(L, n_target_layers) if args.init == "target" else []
        with torch.no_grad():
            model.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
            for i, j in enumerate(picks):
                model.model.layers[i].load_state_dict(target.model.layers[j].state_dict())
            if picks:
                model.model.norm.load_state_dict(target.model.norm.state_dict())
        model.to(dev).train()
        if not args.train_embed:
            model.model.embed_tokens.weight.requires_grad_(False)
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        ntrain = sum(p.numel() for _, p in params)
        nparams = sum(p.numel() for p in model.parameters())
        cost = matrix_params(model) / target_matrix_params
        print(f"[model L={L}] parameters={nparams} trainable={ntrain} init={args.init} "
              f"(target layers {picks}) attn={model.config._attn_implementation} layer_types={model.config.layer_types} "
              f"forward cost vs target {cost:.3f}")
        opt = torch.optim.AdamW([{"params": [p for n, p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
                                 {"params": [p for n, p in params if p.dim() < 2], "weight_decay": 0.0}],
                                lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
        gen = torch.Generator(device=dev)
        gen.manual_seed(args.seed)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        ev0 = teacher_forced(model, val_w, True)
        history = [(0, None, ev0["kl"], ev0["top1_agree"])]
        print(f"[eval L={L}] step 0 val_kl {ev0['kl']:.4f} val_top1_agree {ev0['top1_agree']:.4f}")
        best = (ev0["top1_agree"], 0, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
        planned, budget = args.steps, args.seconds
        warmup = min(args.warmup, max(1, planned // 10))
        step, log_loss, last_loss = 0, torch.zeros((), device=dev), None
        torch.cuda.synchronize()
        t0 = time.time()
        while True:
            elapsed = time.time() - t0
            if step >= planned or elapsed >= budget:
                break
            progress = max(step / planned, elapsed / budget)  # whichever budget runs out first
            if step < warmup:
                lr = args.lr * (step + 1) / warmup
            else:
                lr = args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
            for g in opt.param_groups:
                g["lr"] = lr
            ix = torch.randint(0, train_gpu.numel() - T - 1, (B,), device=dev, generator=gen)
            chunk = train_gpu[ix[:, None] + span[None, :]]
            x = chunk[:, :-1]
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                tl = target(input_ids=x, use_cache=False).logits
            tlp = F.log_softmax(tl.float(), -1).reshape(-1, V)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                dl = model(input_ids=x, use_cache=False).logits
            dlp = F.log_softmax(dl.float(), -1).reshape(-1, V)
            loss = F.kl_div(dlp, tlp, log_target=True, reduction="batchmean")  # KL(target || draft) per token
            if args.ce_weight:
                loss = loss + args.ce_weight * F.nll_loss(dlp, chunk[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for _, p in params], 1.0)
            opt.step()
            step += 1
            log_loss += loss.detach()
            if step % args.log_every == 0:
                last_loss = (log_loss / args.log_every).item()
                log_loss.zero_()
                el = time.time() - t0
                print(f"[train L={L}] step {step} loss {last_loss:.4f} lr {lr:.2e} elapsed {el:.1f}s "
                      f"ms/step {1000*el/step:.1f}")
            if step % args.eval_every == 0:
                ev = teacher_forced(model, val_w, True)
                history.append((step, last_loss, ev["kl"], ev["top1_agree"]))
                mark = ""
                if ev["top1_agree"] > best[0]:
                    best = (ev["top1_agree"], step, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
                    mark = " *best"
                print(f"[eval L={L}] step {step} val_kl {ev['kl']:.4f} val_top1_agree {ev['top1_agree']:.4f}{mark}")
        torch.cuda.synchronize()
        train_s = time.time() - t0
        if step % args.eval_every != 0:
            ev = teacher_forced(model, val_w, True)
            history.append((step, last_loss, ev["kl"], ev["top1_agree"]))
            print(f"[eval L={L}] step {step} val_kl {ev['kl']:.4f} val_top1_agree {ev['top1_agree']:.4f}")
            if ev["top1_agree"] > best[0]:
                best = (ev["top1_agree"], step, None)
        if best[2] is not None:
            model.load_state_dict(best[2])
        del opt
        print(f"[train L={L}] done: steps={step} time={train_s:.1f}s tokens_seen={step*B*T} kept step {best[1]} "
              f"(val top-1 agreement {best[0]:.4f}, autocast)")
        round_to_bf16(model)  # measure exactly the weights that will be saved
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        val_acc = acceptance(model, val_ids, args.positions, args.seed)
        info = {"layers": L, "parameters": nparams, "trainable": ntrain, "init_from_target_layers": picks,
                "steps": step, "train_seconds": round(train_s, 1), "tokens_seen": step * B * T,
                "warmup": warmup, "kept_step": best[1], "history": history,
                "cost_ratio": cost, "val_acceptance": val_acc, "val_est_speedup": est_speedup(val_acc, cost)}
        return model, info

    results, models = {}, {}
    t_loop = time.time()
    for L in depths:
        models[L], results[L] = train_depth(L)
        r = results[L]
        print(f"[val L={L}] " + "  ".join(
            f"k={k}: acc {v['mean_accepted']:.3f} tok/step {v['tokens_per_step']:.3f} est.speedup {r['val_est_speedup'][k]:.3f}"
            for k, v in r["val_acceptance"].items()))
    train_loop_s = time.time() - t_loop
    chosen = max(depths, key=lambda L: max(results[L]["val_est_speedup"].values()))
    print(f"[choose] kept {chosen} layer(s): best estimated speedup on validation "
          + ", ".join(f"L={L}: {max(results[L]['val_est_speedup'].values()):.3f}" for L in depths))

    # Held-out figures of every depth (the choice above used validation only).
    for L in depths:
        results[L]["heldout_acceptance"] = acceptance(models[L], heldout_ids, args.positions, args.seed + 1)
        results[L]["heldout_teacher_forced"] = teacher_forced(models[L], held_w, False)
        results[L]["heldout_est_speedup"] = est_speedup(results[L]["heldout_acceptance"], results[L]["cost_ratio"])
        if L != chosen:
            del models[L]

    # ---- save the chosen depth ----
    out = args.out
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    model = models.pop(chosen)
    model.to(torch.bfloat16)
    model.config.use_cache = True
    try:
        model.save_pretrained(out, safe_serialization=True)
    except TypeError:
        model.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    for name in os.listdir(out):  # keep only the weights from save_pretrained
        if name != "model.safetensors":
            os.remove(os.path.join(out, name))
    cfgd = draft_config_dict(tcfg, chosen)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfgd, f, indent=2)
        f.write("\n")
    for name in FROM_TARGET:
        shutil.copyfile(os.path.join(args.target, name), os.path.join(out, name))

    # ---- checks and final figures on the saved folder ----
    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        keys = sorted(f.keys())
        dtypes = {str(f.get_slice(k).get_dtype()) for k in keys}
    with safe_open(os.path.join(args.target, "model.safetensors"), framework="pt") as f:
        tkeys = sorted(f.keys())
    want = sorted(k for k in tkeys if not k.startswith("model.layers.") or int(k.split(".")[2]) < chosen)
    print(f"[check] safetensors: {len(keys)} tensors, dtypes {dtypes}, names == target's first {chosen} layer(s) + "
          f"embed + norm: {keys == want}, lm_head.weight absent: {'lm_head.weight' not in keys}")
    # Checks after saving report rather than abort: the folder is kept either way.
    failed = []
    if keys != want or "lm_head.weight" in keys or dtypes != {"BF16"}:
        failed.append(f"safetensors names/dtypes: {keys} {dtypes}")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).to(dev).eval()
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        failed.append("lm_head not tied to embed_tokens after reload")
    if list(model.config.layer_types) != ["full_attention"] * chosen:
        failed.append(f"reloaded layer_types {model.config.layer_types}")
    for i, layer in enumerate(model.model.layers):
        if getattr(layer.self_attn, "sliding_window", None) is not None:
            failed.append(f"reloaded layer {i} has a sliding window")
    auto_tok = transformers.AutoTokenizer.from_pretrained(out)
    probe = heldout_text[:2000]
    tok_same = auto_tok(probe)["input_ids"] == tok.encode(probe).ids
    if not tok_same:
        failed.append("AutoTokenizer differs from the target's tokenizer on a probe")
    print(f"[check] reloaded: layers {model.config.num_hidden_layers}, attn {model.config._attn_implementation}, "
          f"AutoTokenizer == target tokenizer on a probe: {tok_same}")

    final_acc = acceptance(model, heldout_ids, args.positions, args.seed + 1)
    final_tf = teacher_forced(model, held_w, False)
    same_as_memory = final_acc == results[chosen]["heldout_acceptance"]
    print(f"[check] reloaded figures equal the in-memory bf16-rounded ones: {same_as_memory}")
    for msg in failed:
        print(f"[check] FAILED: {msg}")

    # Speculative greedy generation from the code prompts; its text must equal
    # the target's plain greedy text (fp32, full recompute each forward).
    @torch.no_grad()
    def target_greedy(ids, n):
        x = torch.tensor([ids], device=dev)
        for _ in range(n):
            nxt = target(input_ids=x, use_cache=False, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
            x = torch.cat([x, nxt], 1)
        return x[0, len(ids):].tolist()

    @torch.no_grad()
    def spec_generate(ids, n, k):
        seq = torch.tensor([ids], device=dev)
        steps = made = 0
        while seq.shape[1] - len(ids) < n:
            cur = seq
            for _ in range(k):
                nxt = model(input_ids=cur, use_cache=False, logits_to_keep=1).logits[:, -1].argmax(-1, keepdim=True)
                cur = torch.cat([cur, nxt], 1)
            t = target(input_ids=cur, use_cache=False, logits_to_keep=k + 1).logits[0].argmax(-1)
            a = int((cur[0, seq.shape[1]:] == t[:k]).int().cumprod(0).sum().item())
            seq = torch.cat([cur[:, :seq.shape[1] + a], t[a].view(1, 1)], 1)
            steps += 1
            made += a + 1
        return seq[0, len(ids):len(ids) + n].tolist(), steps, made

    prompts = tdm.PROMPTS[:2] if args.smoke else tdm.PROMPTS
    gen = {}
    refs = [target_greedy(tok.encode(p).ids, args.gen_tokens) for p in prompts]
    for k in ks:
        steps = made = same = 0
        for p, ref in zip(prompts, refs):
            got, s, m = spec_generate(tok.encode(p).ids, args.gen_tokens, k)
            steps, made, same = steps + s, made + m, same + (got == ref)
        gen[str(k)] = {"prompts": len(prompts), "tokens_per_prompt": args.gen_tokens, "verify_steps": steps,
                       "tokens_per_step": made / steps, "outputs_equal_target_greedy": same}
    for k, g in gen.items():
        print(f"[generate] k={k}: {g['verify_steps']} verify steps, {g['tokens_per_step']:.3f} tokens/step, "
              f"{g['outputs_equal_target_greedy']}/{g['prompts']} outputs equal the target's greedy output")

    print(f"[heldout] chosen L={chosen}: top-1 agreement {final_tf['top1_agree']:.4f} over {final_tf['tokens']} tokens, "
          f"KL {final_tf['kl']:.4f}, draft ppl {math.exp(final_tf['draft_ce']):.3f}")
    for k, v in final_acc.items():
        print(f"[heldout] k={k}: mean accepted drafts/step {v['mean_accepted']:.3f}, "
              f"tokens/verify step {v['tokens_per_step']:.3f}, all k accepted {v['all_accepted_rate']:.3f}")

    # ---- summary, README ----
    wall = time.time() - t_start
    gpu = torch.cuda.get_device_name(0)
    argv = list(sys.argv[1:])
    cmd = "python3 tools/train_draft_model.py " + " ".join(json.dumps(a) if " " in a else a for a in argv)
    env = {"gpu": gpu, "python": sys.version.split()[0], "torch": torch.__version__,
           "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
           "safetensors": safetensors.__version__, "platform": platform.platform()}
    protocol = (f"{args.positions} positions p drawn uniformly (torch.Generator seed {args.seed + 1}) in "
                f"[{ctx}, n_tokens]; context = the {ctx} heldout.txt tokens before p (so context + {kmax} drafts = "
                f"{T} tokens, the training length); fp32 compute (bf16 weights upcast, TF32 off), no KV cache; "
                f"the draft proposes {kmax} tokens greedily, the target scores context + drafts in one forward; "
                f"accepted = longest draft prefix equal to the target's argmax; for k < {kmax}, accepted(k) = "
                f"min(accepted({kmax}), k) since greedy drafts for k are a prefix of those for {kmax}; "
                f"tokens per verify step = accepted + 1")
    summary = {
        "target": args.target, "chosen_layers": chosen, "command": cmd, "seed": args.seed,
        "script_wall_seconds": round(wall, 1), "training_loops_seconds": round(train_loop_s, 1),
        "heldout": {"acceptance": final_acc, "acceptance_protocol": protocol,
                    "teacher_forced": final_tf,
                    "teacher_forced_protocol": (f"{n_held} consecutive non-overlapping windows of {T + 1} tokens of "
                                                f"heldout.txt (BOS + text); inputs = first {T} of each; fp32")},
        "generation_check": gen,
        "checks_failed": failed, "reloaded_equals_in_memory": same_as_memory,
        "variants": {str(L): r for L, r in results.items()},
        "settings": {k: v for k, v in vars(args).items()},
        "data": {"stdlib": stdlib, "files": len(files), "train_files": len(train_files),
                 "train_bytes": nbytes(train_files), "train_tokens": int(train_ids.numel()),
                 "val_tokens": int(val_ids.numel()), "heldout_tokens": int(heldout_ids.numel()),
                 "target_heldout_reproduced": same_split},
        "env": env,
    }
    with open(os.path.join(out, "train_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")

    def acc_table(res, spd):
        rows = ["| k | mean accepted drafts / step | mean tokens / verify step | all k accepted | est. speedup (proxy) |",
                "| --- | --- | --- | --- | --- |"]
        for k, v in res.items():
            rows.append(f"| {k} | {v['mean_accepted']:.3f} | {v['tokens_per_step']:.3f} | "
                        f"{v['all_accepted_rate']:.3f} | {spd[k]:.2f} |")
        return "\n".join(rows)

    var_rows = ["| layers | parameters (trainable) | steps | train s | kept step | val top-1 agree | "
                + " | ".join(f"val tok/step k={k}" for k in ks) + " | c | best val est. speedup | heldout top-1 agree | "
                + " | ".join(f"heldout tok/step k={k}" for k in ks) + " |",
                "| " + " | ".join(["---"] * (9 + 2 * len(ks))) + " |"]
    for L, r in results.items():
        kept = [h for h in r["history"] if h[0] == r["kept_step"]][-1]
        var_rows.append(
            f"| {L} | {r['parameters']:,} ({r['trainable']:,}) | {r['steps']} | {r['train_seconds']} | {r['kept_step']} | "
            f"{kept[3]:.4f} | " + " | ".join(f"{r['val_acceptance'][str(k)]['tokens_per_step']:.3f}" for k in ks)
            + f" | {r['cost_ratio']:.3f} | {max(r['val_est_speedup'].values()):.3f} | {r['heldout_teacher_forced']['top1_agree']:.4f} | "
            + " | ".join(f"{r['heldout_acceptance'][str(k)]['tokens_per_step']:.3f}" for k in ks) + " |")
    hist = "\n".join(f"    L={L} step {s:5d}  train KL {('%.4f' % tl) if tl is not None else '  -   '}  val KL {vk:.4f}  "
                     f"val top-1 agree {va:.4f}" for L, r in results.items() for s, tl, vk, va in r["history"])
    gen_rows = "\n".join(f"| {k} | {g['verify_steps']} | {g['tokens_per_step']:.3f} | {g['outputs_equal_target_greedy']}/{g['prompts']} |"
                         for k, g in gen.items())
    r = results[chosen]
    nparams = r["parameters"]
    readme = f"""# kvq-code-tiny-draft: a draft model for speculative decoding with kvq-code-tiny

A {chosen}-layer causal language model distilled from kvq's default model
[`models/kvq-code-tiny`](../kvq-code-tiny/README.md) (the target) by
`tools/train_draft_model.py`, to serve as its drafter:

    --speculative-config '{{"method": "draft_model", "model": "models/kvq-code-tiny-draft", "num_speculative_tokens": 4}}'

It shares the target's tokenizer (tokenizer.json, tokenizer_config.json and generation_config.json are copies
of the target's: vocab {V}, `<|endoftext|>`=0 BOS/EOS, `<|im_start|>`=1, `<|im_end|>`=2), hidden size, head
layout and embedding, so kvq loads it exactly like the target.

## Architecture (Hugging Face `Qwen3ForCausalLM`, config.json)

- {nparams:,} parameters (bf16 safetensors): hidden {cfgd['hidden_size']}, {chosen} decoder layer(s), intermediate
  {cfgd['intermediate_size']}, SiLU-gated MLP, RMSNorm eps {cfgd['rms_norm_eps']}, no biases, Qwen3 `q_norm`/`k_norm`.
- attention: {cfgd['num_attention_heads']} query heads, {cfgd['num_key_value_heads']} KV heads, head_dim
  {cfgd['head_dim']}; RoPE theta {cfgd['rope_parameters']['rope_theta']}; max_position_embeddings
  {cfgd['max_position_embeddings']}; `layer_types` = {cfgd['layer_types']} (no sliding window:
  `use_sliding_window` false, `sliding_window` null).
- vocab {V}, embeddings tied to the output head (no `lm_head.weight` in the file).
- config.json is the target's config.json with `num_hidden_layers`, `layer_types`, `use_sliding_window` and
  `sliding_window` changed, nothing else.

## Training

- Command: `{cmd}`
- Target: `{args.target}`, run in fp32 weights under bf16 autocast (no gradients).
- Data: the target's training split, built by importing `tools/train_default_model.py`
  (`collect_files`, `split_files`): `*.py` under `sysconfig.get_paths()['stdlib']` = `{stdlib}`
  (CPython {sys.version.split()[0]}), {len(train_files)} training files / {nbytes(train_files):,} bytes /
  {train_ids.numel():,} tokens (documents = `<|endoftext|>` + tokens); validation files (i % 20 == 10) choose the
  checkpoint and the depth; held-out files (i % 20 == 0) only measure. This split reproduces the target's
  heldout.txt byte for byte: {same_split}.
- Loss: KL(target softmax || draft softmax) per token over all {T} positions of random {T}+1-token windows
  (batch {B}){'' if not args.ce_weight else f' + {args.ce_weight} x next-token cross-entropy'}.
- Initialisation: embedding copied from the target and {'trained' if args.train_embed else 'frozen (so the tied output head is the target' + "'" + 's too)'};
  {'decoder layers and the final norm copied from target layers ' + str(r['init_from_target_layers']) + ' (then trained)' if args.init == 'target' else 'decoder layers random (std 0.02)'}.
- AdamW (betas 0.9/0.95, weight decay {args.weight_decay} on matrices), peak lr {args.lr}, {r['warmup']} warm-up steps,
  cosine to {args.min_lr_frac} x peak over {args.steps} planned steps or {args.seconds:.0f} s, whichever comes first;
  grad clip 1.0; bf16 autocast; TF32 on. Validation (64 fixed windows, bf16 autocast) every {args.eval_every} steps;
  the checkpoint with the best top-1 agreement with the target is kept. Seed {args.seed} (torch.manual_seed and
  the window sampler) for every depth.
- Each depth in `--layers {args.layers}` trained with the same budget; kept: the depth whose best estimated speedup on
  the validation split is highest. Estimated speedup = mean tokens per verify step / (1 + k x c), c = the draft's
  weight-matrix parameters over the target's ({', '.join(f'{L} layer(s): c = {results[L]["cost_ratio"]:.3f}' for L in depths)};
  the tied 4096 x 256 embedding counts once, as the output head): the cost model of memory-bound decoding, where a
  forward reads every weight once. A proxy: it ignores attention over the KV cache, the verify step's k+1 tokens
  and launch overheads (which favour the deeper draft, as fixed costs shrink the depth's share).
- Hardware: {gpu}; Python {env['python']}, torch {env['torch']}, transformers {env['transformers']},
  tokenizers {env['tokenizers']}, safetensors {env['safetensors']}.
- Wall time: training loops (all depths, with their validation evaluations) {train_loop_s:.1f} s; whole script
  {wall:.1f} s (everything up to writing this README).

Per depth (validation acceptance: same protocol as below on the validation split, positions seed {args.seed}):

{chr(10).join(var_rows)}

Validation history (KL in nats per token; train KL = running mean over the last {args.log_every} steps):

{hist}

## Acceptance on held-out text (the kept {chosen}-layer model, reloaded from these files)

Greedy speculative decoding measured in PyTorch on `../kvq-code-tiny/heldout.txt` ({heldout_ids.numel():,} tokens).
Protocol: {protocol}.

{acc_table(final_acc, est_speedup(final_acc, r['cost_ratio']))}

Top-1 agreement of the draft's argmax with the target's (teacher forced, {final_tf['tokens']:,} positions of
{n_held} consecutive {T}-token windows, fp32): **{final_tf['top1_agree']:.4f}**; mean KL(target || draft)
{final_tf['kl']:.4f} nats/token; the draft's own held-out perplexity {math.exp(final_tf['draft_ce']):.3f}
(the target's: 21.69).

Generation check: speculative greedy decoding (full recompute, fp32) of {args.gen_tokens} tokens from each of
{len(prompts)} code prompts of `../kvq-code-tiny/prompts.txt` (BOS + prompt, no EOS stop); outputs must equal the target's
plain greedy outputs. A looping greedy continuation is easier to draft than held-out text, so these
rates are higher than the table above.

| k | verify steps | tokens / verify step | outputs equal to target greedy |
| --- | --- | --- | --- |
{gen_rows}

All figures are also in `train_summary.json`.

## License and origin

Distilled from `models/kvq-code-tiny` (trained from scratch by this repository); no other pretrained weights
were used. The training text is the Python standard library from CPython, copyright Python Software
Foundation, under the PSF License Agreement: see `../kvq-code-tiny/LICENSE-PSF.txt` (also at
https://docs.python.org/3/license.html).

## Files (sha256)

"""
    files_info = []
    for name in sorted(os.listdir(out)):
        pth = os.path.join(out, name)
        files_info.append(f"    {sha256_file(pth)}  {name} ({os.path.getsize(pth):,} bytes)")
    readme += "\n".join(files_info) + "\n"
    with open(os.path.join(out, "README.md"), "w", encoding="utf-8") as f:
        f.write(readme)
    shutil.rmtree(cfg_dir, ignore_errors=True)
    total = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
    print(f"[done] {out}: {total/1e6:.2f} MB, kept {chosen} layer(s), script wall time {time.time()-t_start:.1f}s")


if __name__ == "__main__":
    main()
