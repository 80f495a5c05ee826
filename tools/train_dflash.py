#!/usr/bin/env python3
"""Train, evaluate and write goldens for kvq's DFlash (block-diffusion) drafter of kvq-code-tiny.

The drafter and its exact inference math are specified in docs/notes/dflash.md. This file holds:

  * a plain PyTorch reference of the drafter forward in kvq's format (`drafter_hidden`,
    `draft_block_logits`: given the target's hidden states of the context and a block
    [bonus token, mask x k], the logits of the k mask rows) -- the oracle for kvq's C++;
  * a plain PyTorch Qwen3 forward (`Qwen3Ref`) used to cross-check transformers' target outputs
    and as the target where transformers is missing (--local-test);
  * training on the target's own greedy continuations of training-split prompts (the target is
    frozen; its hidden states are recomputed each step), with random anchors, a variable
    block length k in 2..8 and exponentially decaying row weights;
  * a greedy speculative-decoding evaluation on models/kvq-code-tiny/heldout.txt
    (mean accepted length per verify step for k = 2, 4, 8);
  * goldens for the C++ implementation (tests/fixtures/goldens/dflash_kvq-code-tiny.json + .bin).

Runs on the GPU machine (torch, transformers, tokenizers, numpy). Safetensors files are read and
written by the small stdlib+numpy code below, so nothing else is needed.

Usage (the command for the committed drafter is recorded in models/kvq-code-tiny-dflash/README.md):
    python3 tools/train_dflash.py --out models/kvq-code-tiny-dflash --goldens tests/fixtures/goldens
Smoke test (seconds): add --smoke and point --out/--goldens at /tmp.
Local logic test without transformers/tokenizers/GPU (byte ids, plain-torch target):
    python3 tools/train_dflash.py --local-test --out /tmp/dfl --goldens /tmp/dfl_g
"""

import argparse
import json
import math
import os
import random
import struct
import sys
import sysconfig
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from train_default_model import collect_files, split_files, sha256_file  # noqa: E402  (stdlib only)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

TARGET_DIR = "models/kvq-code-tiny"
ARCH = "KvqDFlashDrafter"


# --------------------------------------------------------------------------------------------
# safetensors (read any F32/F16/BF16 file as fp32; write BF16)
# --------------------------------------------------------------------------------------------

def read_safetensors(path):
    """Returns ({name: fp32 CPU tensor}, metadata). BF16 is widened exactly (bits << 16)."""
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n].decode("utf-8"))
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b, e = info["data_offsets"]
        raw = data[base + b: base + e]
        dt = info["dtype"]
        if dt == "BF16":
            u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = u.view(np.float32)
        elif dt == "F16":
            arr = np.frombuffer(raw, dtype="<f2").astype(np.float32)
        elif dt == "F32":
            arr = np.frombuffer(raw, dtype="<f4").astype(np.float32)
        else:
            raise ValueError(f"{path}: tensor {name} has dtype {dt}; only F32/F16/BF16 are read")
        out[name] = torch.from_numpy(arr.copy()).reshape(info["shape"])
    return out, header.get("__metadata__", {})


def write_safetensors_bf16(path, tensors, metadata):
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu", torch.bfloat16).contiguous()
        raw = t.view(torch.int16).numpy().astype("<i2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for raw in blobs:
            f.write(raw)


# --------------------------------------------------------------------------------------------
# shared math (Qwen3 conventions: RMSNorm in fp32, rotate-half RoPE, GQA head h -> kv head h // g)
# --------------------------------------------------------------------------------------------

def rms_norm(x, w, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * y.to(x.dtype)


def rope_cos_sin(pos, head_dim, theta):
    """pos: integer tensor [B, T] -> cos, sin [B, T, head_dim] in fp32 (HF's fp32 recipe)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=pos.device).float() / head_dim))
    ang = pos.float()[..., None] * inv  # [B, T, d/2]
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    """x: [B, T, heads, d]; cos/sin: [B, T, d]."""
    d2 = x.shape[-1] // 2
    rot = torch.cat([-x[..., d2:], x[..., :d2]], dim=-1)
    return x * cos[:, :, None, :].to(x.dtype) + rot * sin[:, :, None, :].to(x.dtype)


def attention(q, k, v, mask):
    """q [B,Tq,nh,d], k/v [B,Tk,nkv,d], mask bool [B,Tq,Tk] (True = visible) or None (all visible).
    Softmax in fp32; scale d^-0.5; query head h reads kv head h // (nh / nkv)."""
    nh, nkv, d = q.shape[2], k.shape[2], q.shape[3]
    g = nh // nkv
    if g > 1:
        k = k.repeat_interleave(g, dim=2)
        v = v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (d ** -0.5)
    if mask is not None:
        s = s.masked_fill(~mask[:, None], float("-inf"))
    p = torch.softmax(s.float(), dim=-1).to(v.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def rope_theta_of(cfg):
    rp = cfg.get("rope_parameters") or {}
    return float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))


# --------------------------------------------------------------------------------------------
# plain-torch Qwen3 target (cross-check of transformers; target for --local-test)
# --------------------------------------------------------------------------------------------

class Qwen3Ref:
    def __init__(self, cfg, weights, device):
        self.cfg = cfg
        self.L = cfg["num_hidden_layers"]
        self.nh, self.nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.d = cfg.get("head_dim") or cfg["hidden_size"] // self.nh
        self.eps = cfg["rms_norm_eps"]
        self.theta = rope_theta_of(cfg)
        lt = cfg.get("layer_types") or ["full_attention"] * self.L
        self.window = [cfg["sliding_window"] if t == "sliding_attention" else None for t in lt]
        self.w = {k: v.to(device, torch.float32) for k, v in weights.items()}
        self.embed = self.w["model.embed_tokens.weight"]
        self.head = self.w.get("lm_head.weight", self.embed)

    @torch.no_grad()
    def forward(self, ids):
        """ids [B, T] (positions 0..T-1) -> logits [B,T,V], [output of decoder layer l for every l]."""
        w, B, T = self.w, ids.shape[0], ids.shape[1]
        pos = torch.arange(T, device=ids.device)[None].expand(B, T)
        cos, sin = rope_cos_sin(pos, self.d, self.theta)
        qi = torch.arange(T, device=ids.device)[:, None]
        ki = torch.arange(T, device=ids.device)[None, :]
        x = self.embed[ids]
        outs = []
        for l in range(self.L):
            p = f"model.layers.{l}."
            h = rms_norm(x, w[p + "input_layernorm.weight"], self.eps)
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(B, T, self.nh, self.d)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(B, T, self.nkv, self.d)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(B, T, self.nkv, self.d)
            q = apply_rope(rms_norm(q, w[p + "self_attn.q_norm.weight"], self.eps), cos, sin)
            k = apply_rope(rms_norm(k, w[p + "self_attn.k_norm.weight"], self.eps), cos, sin)
            m = ki <= qi
            if self.window[l]:
                m = m & (qi - ki < self.window[l])
            o = attention(q, k, v, m[None].expand(B, T, T))
            x = x + o.reshape(B, T, self.nh * self.d) @ w[p + "self_attn.o_proj.weight"].T
            h = rms_norm(x, w[p + "post_attention_layernorm.weight"], self.eps)
            x = x + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
                @ w[p + "mlp.down_proj.weight"].T
            outs.append(x)
        logits = rms_norm(x, w["model.norm.weight"], self.eps) @ self.head.T
        return logits, outs


def pick_next(logits, sample, gen):
    if not sample:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits.float(), dim=-1), 1, generator=gen)[:, 0]


class RefTarget:
    """Target interface over Qwen3Ref."""

    def __init__(self, path, device, layer_ids):
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        weights, _ = read_safetensors(os.path.join(path, "model.safetensors"))
        self.m = Qwen3Ref(cfg, weights, device)
        self.layer_ids = list(layer_ids)
        self.embed = self.m.embed
        self.name = "Qwen3Ref (tools/train_dflash.py)"

    def logits_and_features(self, ids):
        logits, outs = self.m.forward(ids)
        return logits, torch.cat([outs[l] for l in self.layer_ids], dim=-1)

    def features(self, ids):
        return self.logits_and_features(ids)[1]

    @torch.no_grad()
    def greedy_generate(self, prefix, n, sample_steps=0, gen=None):
        x = prefix
        for i in range(n):
            nxt = pick_next(self.m.forward(x)[0][:, -1], i < sample_steps, gen)
            x = torch.cat([x, nxt[:, None]], dim=1)
        return x[:, prefix.shape[1]:]


class HFTarget:
    """Target interface over transformers' Qwen3ForCausalLM (fp32). Hidden states are taken with
    forward hooks on the decoder layers: the output of layer l (pre final norm) for every l,
    including the last (transformers' output_hidden_states[-1] is post-norm)."""

    def __init__(self, path, device, layer_ids, attn="sdpa"):
        import transformers
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=attn).to(device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.layer_ids = list(layer_ids)
        self.cap = {}
        for l in range(len(self.model.model.layers)):
            self.model.model.layers[l].register_forward_hook(self._hook(l))
        self.embed = self.model.get_input_embeddings().weight
        self.name = f"transformers {transformers.__version__} Qwen3ForCausalLM ({attn})"

    def _hook(self, l):
        def f(mod, inp, out):
            self.cap[l] = out[0] if isinstance(out, tuple) else out
        return f

    @torch.no_grad()
    def logits_and_features(self, ids):
        self.cap.clear()
        logits = self.model(input_ids=ids, use_cache=False).logits.float()
        return logits, torch.cat([self.cap[l].float() for l in self.layer_ids], dim=-1)

    @torch.no_grad()
    def all_layer_outputs(self, ids):
        self.cap.clear()
        out = self.model(input_ids=ids, use_cache=False, output_hidden_states=True)
        return out.logits.float(), [self.cap[l].float() for l in range(len(self.model.model.layers))], \
            [h.float() for h in out.hidden_states]

    @torch.no_grad()
    def features(self, ids):
        self.cap.clear()
        self.model.model(input_ids=ids, use_cache=False)
        return torch.cat([self.cap[l].float() for l in self.layer_ids], dim=-1)

    @torch.no_grad()
    def greedy_generate(self, prefix, n, sample_steps=0, gen=None):
        """n tokens after prefix: the first sample_steps drawn at temperature 1, the rest greedy."""
        out = self.model(input_ids=prefix, use_cache=True, logits_to_keep=1)
        pkv = out.past_key_values
        nxt = pick_next(out.logits[:, -1], sample_steps > 0, gen)
        toks = [nxt]
        for i in range(1, n):
            out = self.model(input_ids=nxt[:, None], past_key_values=pkv, use_cache=True)
            pkv = out.past_key_values
            nxt = pick_next(out.logits[:, -1], i < sample_steps, gen)
            toks.append(nxt)
        self.cap.clear()
        return torch.stack(toks, dim=1)


# --------------------------------------------------------------------------------------------
# the drafter (tensor names = kvq's format, see docs/notes/dflash.md)
# --------------------------------------------------------------------------------------------

class Norm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))


class DrafterLayer(nn.Module):
    """A Qwen3 decoder layer's parameters, under Qwen3's names."""

    def __init__(self, H, nh, nkv, d, inter):
        super().__init__()
        sa = nn.Module()
        sa.q_proj = nn.Linear(H, nh * d, bias=False)
        sa.k_proj = nn.Linear(H, nkv * d, bias=False)
        sa.v_proj = nn.Linear(H, nkv * d, bias=False)
        sa.o_proj = nn.Linear(nh * d, H, bias=False)
        sa.q_norm = Norm(d)
        sa.k_norm = Norm(d)
        self.self_attn = sa
        mlp = nn.Module()
        mlp.gate_proj = nn.Linear(H, inter, bias=False)
        mlp.up_proj = nn.Linear(H, inter, bias=False)
        mlp.down_proj = nn.Linear(inter, H, bias=False)
        self.mlp = mlp
        self.input_layernorm = Norm(H)
        self.post_attention_layernorm = Norm(H)


class Drafter(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        H, nh, nkv, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        dc = cfg["dflash_config"]
        self.H, self.nh, self.nkv, self.d = H, nh, nkv, d
        self.eps = cfg["rms_norm_eps"]
        self.theta = rope_theta_of(cfg)
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(
            [DrafterLayer(H, nh, nkv, d, cfg["intermediate_size"]) for _ in range(cfg["num_hidden_layers"])])
        self.model.norm = Norm(H)
        self.fc = nn.Linear(len(dc["target_layer_ids"]) * dc["target_hidden_size"], H, bias=False)
        self.hidden_norm = Norm(H)
        self.mask_embedding = nn.Parameter(torch.zeros(H))


def fuse_context(dr, feats):
    """feats [B,S,n*Ht] (target layer outputs concatenated in target_layer_ids order) -> c [B,S,H]."""
    return rms_norm(dr.fc(feats), dr.hidden_norm.weight, dr.eps)


def layer_context_kv(dr, layer, c, cos, sin):
    """The context K/V of one drafter layer ("KV injection"): k_proj / v_proj of the fused feature
    (no input_layernorm), k_norm, RoPE at the context positions. Depends only on c at each position."""
    B, S = c.shape[0], c.shape[1]
    sa = layer.self_attn
    k = sa.k_proj(c).view(B, S, dr.nkv, dr.d)
    k = apply_rope(rms_norm(k, sa.k_norm.weight, dr.eps), cos, sin)
    v = sa.v_proj(c).view(B, S, dr.nkv, dr.d)
    return k, v


def drafter_hidden(dr, c, ctx_pos, x, blk_pos, mask):
    """c [B,S,H] fused context features at positions ctx_pos [B,S]; x [B,Q,H] block input embeddings at
    positions blk_pos [B,Q]; mask bool [B,Q,S+Q] over (context keys, then block keys) or None = all
    visible (inference: one block, non-causal). Returns the final-normed block hidden states [B,Q,H]."""
    B, Q = x.shape[0], x.shape[1]
    cos_c, sin_c = rope_cos_sin(ctx_pos, dr.d, dr.theta)
    cos_b, sin_b = rope_cos_sin(blk_pos, dr.d, dr.theta)
    for layer in dr.model.layers:
        sa, mlp = layer.self_attn, layer.mlp
        kc, vc = layer_context_kv(dr, layer, c, cos_c, sin_c)
        h = rms_norm(x, layer.input_layernorm.weight, dr.eps)
        q = apply_rope(rms_norm(sa.q_proj(h).view(B, Q, dr.nh, dr.d), sa.q_norm.weight, dr.eps), cos_b, sin_b)
        kb = apply_rope(rms_norm(sa.k_proj(h).view(B, Q, dr.nkv, dr.d), sa.k_norm.weight, dr.eps), cos_b, sin_b)
        vb = sa.v_proj(h).view(B, Q, dr.nkv, dr.d)
        k = torch.cat([kc.to(kb.dtype), kb], dim=1)
        v = torch.cat([vc.to(vb.dtype), vb], dim=1)
        o = attention(q, k, v, mask)
        x = x + sa.o_proj(o.reshape(B, Q, dr.nh * dr.d))
        h = rms_norm(x, layer.post_attention_layernorm.weight, dr.eps)
        x = x + mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))
    return rms_norm(x, dr.model.norm.weight, dr.eps)


def block_inputs(dr, embed_w, bonus, k):
    """[bonus embedding, mask_embedding x k] -> [k+1, H]."""
    return torch.cat([embed_w[bonus].reshape(1, -1).to(dr.mask_embedding.dtype),
                      dr.mask_embedding[None].expand(k, dr.H)], dim=0)


@torch.no_grad()
def draft_block_logits(dr, embed_w, feats, bonus, k, return_hidden=False):
    """THE ORACLE. feats [S, n*Ht]: target layer outputs (concatenated) at context positions 0..S-1;
    bonus: the token at position S (the target's last sampled token); k: mask tokens at S+1..S+k.
    Returns the logits [k, V] of block rows 1..k (row j drafts the token at position S+j)."""
    S = feats.shape[0]
    dev = feats.device
    c = fuse_context(dr, feats[None])
    x = block_inputs(dr, embed_w, bonus, k)[None]
    ctx_pos = torch.arange(S, device=dev)[None]
    blk_pos = torch.arange(S, S + k + 1, device=dev)[None]
    hid = drafter_hidden(dr, c, ctx_pos, x, blk_pos, None)[0]
    logits = hid[1:] @ embed_w.T
    return (logits, hid, c[0]) if return_hidden else logits


def drafter_config(args, tcfg):
    n_layers = args.layers
    return {
        "architectures": [ARCH],
        "model_type": "kvq_dflash",
        "dtype": "bfloat16",
        "hidden_size": tcfg["hidden_size"],
        "intermediate_size": tcfg["intermediate_size"],
        "num_hidden_layers": n_layers,
        "num_attention_heads": tcfg["num_attention_heads"],
        "num_key_value_heads": tcfg["num_key_value_heads"],
        "head_dim": tcfg["head_dim"],
        "hidden_act": "silu",
        "rms_norm_eps": tcfg["rms_norm_eps"],
        "attention_bias": False,
        "rope_parameters": {"rope_theta": rope_theta_of(tcfg), "rope_type": "default"},
        "max_position_embeddings": tcfg["max_position_embeddings"],
        "vocab_size": tcfg["vocab_size"],
        "tie_word_embeddings": True,
        "layer_types": ["full_attention"] * n_layers,
        "sliding_window": None,
        "dflash_config": {
            "target_model": "kvq-code-tiny",
            "target_architecture": "Qwen3ForCausalLM",
            "num_target_layers": tcfg["num_hidden_layers"],
            "target_hidden_size": tcfg["hidden_size"],
            "target_layer_ids": [int(x) for x in args.target_layers.split(",")],
            "target_hidden_state": "output of target decoder layer l (residual stream after its MLP add), "
                                   "before the final norm",
            "block_size": 1 + args.max_k,
            "max_speculative_tokens": args.max_k,
            "min_speculative_tokens": 1,
            "trained_speculative_tokens": sorted(set(parse_k_mix(args.k_mix))),
            "mask_embedding": "mask_embedding",
            "mask_token_id": None,
            "attention": "non_causal",
            "context_kv": "k_proj/v_proj of hidden_norm(fc(concat target_layer_ids)), k_norm, RoPE at the "
                          "context position; no input_layernorm",
            "embed_tokens": "target",
            "lm_head": "target",
        },
    }


def parse_k_mix(s):
    return [int(x) for x in s.split(",") if x.strip()]


# --------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------

def token_streams(args, tok):
    """{train, valA, valB: 1-D LongTensor}: each document is BOS + its tokens (the target's recipe).
    valA / valB are the odd / even files of the target's validation split (never trained on by the
    target): valA gives training prompts, valB the drafter's validation prompts."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = collect_files(stdlib, args.max_files or None)
    train, val, _ = split_files(files)
    if tok is None:  # --local-test: bytes as ids
        def stream(fs):
            ids = []
            for _, t in fs:
                ids.append(0)
                ids.extend(t.encode("utf-8"))
            return torch.tensor(ids, dtype=torch.long)
    else:
        def stream(fs):
            ids = []
            for e in tok.encode_batch([t for _, t in fs], add_special_tokens=False):
                ids.append(0)
                ids.extend(e.ids)
            return torch.tensor(ids, dtype=torch.long)
    val_a, val_b = val[1::2], val[0::2]
    info = {"stdlib": stdlib, "python": sys.version.split()[0], "files": len(files),
            "train_files": len(train), "val_files": len(val), "val_prompt_files": len(val_a),
            "val_eval_files": len(val_b)}
    return {"train": stream(train), "valA": stream(val_a), "valB": stream(val_b)}, info


def make_generated_set(target, stream, per_len, prefix_lens, gen_len, batch, seed, device, log, out,
                       sample_steps=0, tag=""):
    """per_len sequences for each P in prefix_lens: a random window of `stream` of P tokens, then
    sample_steps tokens drawn from the target at temperature 1, then the target's greedy continuation
    of gen_len tokens. Added to out[P + sample_steps] (LongTensor [n, P + sample_steps + gen_len]);
    the greedy part starts at index P + sample_steps."""
    g = torch.Generator().manual_seed(seed)
    gs = torch.Generator(device=device).manual_seed(seed + 17)
    for P in prefix_lens:
        rows = []
        left = per_len
        while left > 0:
            b = min(batch, left)
            starts = torch.randint(0, stream.numel() - P - 1, (b,), generator=g)
            pre = torch.stack([stream[s:s + P] for s in starts.tolist()]).to(device)
            gen = target.greedy_generate(pre, sample_steps + gen_len, sample_steps, gs)
            rows.append(torch.cat([pre, gen], dim=1))
            left -= b
        key = P + sample_steps
        new = torch.cat(rows, 0)
        out[key] = torch.cat([out[key], new], 0) if key in out else new
        log(f"[gen] {tag} P={P} sampled={sample_steps}: {new.shape[0]} sequences of {P}+{sample_steps}+{gen_len}")
    return out


# --------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------

def block_batch(dr, embed_w, feats, toks, P, k, n_anchors, gen, gamma):
    """Loss on n_anchors random blocks per sequence. toks [B,S] = P prompt tokens + the target's
    greedy continuation; anchors a in [P, S-1-k]: block = [toks[a], mask x k] at positions a..a+k,
    it sees context positions < a (non-causal inside the block, nothing of other blocks); row j's
    label is toks[a+j] (the target's greedy token there), weight exp(-(j-1)/gamma)."""
    B, S = toks.shape
    dev = toks.device
    T = k + 1
    R = S - k - P  # anchors P..S-1-k
    n = min(n_anchors, R)
    anchors = torch.rand(B, R, generator=gen, device=dev).argsort(dim=1)[:, :n].sort(dim=1).values + P
    offs = torch.arange(T, device=dev)
    pos = anchors[:, :, None] + offs  # [B,n,T]
    labels = toks.gather(1, pos.view(B, -1)).view(B, n, T)[:, :, 1:]
    emb0 = embed_w[toks.gather(1, anchors)]  # [B,n,H]
    x = torch.cat([emb0[:, :, None].to(dr.mask_embedding.dtype),
                   dr.mask_embedding.view(1, 1, 1, -1).expand(B, n, k, dr.H)], dim=2).view(B, n * T, dr.H)
    qa = anchors.repeat_interleave(T, dim=1)  # [B, n*T] anchor of each query's block
    ctx_mask = torch.arange(S, device=dev)[None, None, :] < qa[:, :, None]  # [B,nT,S]
    qb = torch.arange(n * T, device=dev) // T
    blk_mask = (qb[:, None] == qb[None, :])[None].expand(B, -1, -1)
    mask = torch.cat([ctx_mask, blk_mask], dim=2)
    c = fuse_context(dr, feats)
    ctx_pos = torch.arange(S, device=dev)[None].expand(B, S)
    hid = drafter_hidden(dr, c, ctx_pos, x, pos.view(B, -1), mask).view(B, n, T, dr.H)[:, :, 1:]
    logits = (hid @ embed_w.T.to(hid.dtype)).float()  # [B,n,k,V]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(B, n, k)
    w = torch.exp(-torch.arange(k, device=dev, dtype=torch.float32) / gamma)  # row j=1..k -> exp(-(j-1)/gamma)
    loss = (ce * w).sum() / (w.sum() * B * n)
    with torch.no_grad():
        correct = logits.argmax(-1) == labels  # [B,n,k]
        tau = 1.0 + correct.long().cumprod(dim=-1).sum(-1).float()  # accepted length of each block
    return loss, correct, tau


def lr_at(step, planned, peak, warmup, min_frac):
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, planned - warmup))
    return peak * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def init_drafter(dr, target_weights, init_layers, seed, log):
    torch.manual_seed(seed)
    for name, p in dr.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    emb = target_weights["model.embed_tokens.weight"]
    with torch.no_grad():
        dr.mask_embedding.copy_(torch.randn(dr.H) * emb.std())
        if init_layers:
            for i, tl in enumerate(init_layers):
                for name, p in dr.model.layers[i].named_parameters():
                    p.copy_(target_weights[f"model.layers.{tl}.{name}"])
            dr.model.norm.weight.copy_(target_weights["model.norm.weight"])
            log(f"[init] drafter layers <- target layers {init_layers}, model.norm <- target's; fc, "
                f"hidden_norm, mask_embedding fresh")


# --------------------------------------------------------------------------------------------
# evaluation: greedy speculative decoding against the target
# --------------------------------------------------------------------------------------------

def spec_run(target, dr, embed_w, ctx, k, steps, device, trace=False):
    """Greedy speculative decoding from context ids `ctx`: each step drafts k tokens after the bonus
    token, verifies [bonus, drafts] with one target forward, accepts the longest agreeing prefix.
    Returns (accepted length per step = accepted drafts + 1, final token list, trace)."""
    seq = list(ctx)
    logits, feats = target.logits_and_features(torch.tensor([seq], device=device))
    bonus = int(logits[0, -1].argmax())
    acc, tr = [], []
    for _ in range(steps):
        S = len(seq)
        d = draft_block_logits(dr, embed_w, feats[0, :S], bonus, k).argmax(-1).tolist()
        block = [bonus] + d
        logits, feats = target.logits_and_features(torch.tensor([seq + block], device=device))
        g = logits[0, S:S + k + 1].argmax(-1).tolist()
        a = 0
        while a < k and d[a] == g[a]:
            a += 1
        if trace:
            tr.append({"start": S, "bonus": bonus, "drafts": d, "target_greedy": g, "accepted_drafts": a})
        seq += block[:a + 1]
        bonus = g[a]
        acc.append(a + 1)
    return acc, seq + [bonus], tr


@torch.no_grad()
def greedy_reference(target, ctx, n, device):
    seq = list(ctx)
    for _ in range(n):
        logits, _ = target.logits_and_features(torch.tensor([seq], device=device))
        seq.append(int(logits[0, -1].argmax()))
    return seq


def evaluate(target, dr, embed_w, heldout_ids, args, device, log):
    rng = random.Random(args.seed + 7)
    cases = []
    for _ in range(args.eval_positions):
        L = rng.randint(args.eval_min_ctx, args.eval_max_ctx)
        s = rng.randint(0, len(heldout_ids) - L - 1)
        cases.append((s, L))
    res = {}
    lossless_checked = 0
    for k in sorted({2, 4, 8, args.max_k}):
        steps_all, per_pos = [], []
        for i, (s, L) in enumerate(cases):
            acc, out, _ = spec_run(target, dr, embed_w, heldout_ids[s:s + L], k, args.eval_steps, device)
            steps_all += acc
            per_pos.append(sum(acc) / len(acc))
            if k == 8 and i < args.lossless_checks:
                ref = greedy_reference(target, heldout_ids[s:s + L], len(out) - L, device)
                if ref != out:
                    raise SystemExit(f"speculative output differs from plain greedy at case {i} (k={k})")
                lossless_checked += 1
        hist = [steps_all.count(j) for j in range(1, k + 2)]
        res[k] = {"mean_accepted_length_per_step": sum(steps_all) / len(steps_all),
                  "mean_over_positions": sum(per_pos) / len(per_pos),
                  "verify_steps": len(steps_all), "histogram_accepted_length_1_to_k+1": hist}
        log(f"[eval] k={k}: mean accepted length per verify step {res[k]['mean_accepted_length_per_step']:.3f} "
            f"(per-position mean {res[k]['mean_over_positions']:.3f}; {len(steps_all)} steps; hist {hist})")
    return {"positions": len(cases), "steps_per_position": args.eval_steps,
            "context_lengths": [args.eval_min_ctx, args.eval_max_ctx], "seed": args.seed + 7,
            "lossless_checked_positions": lossless_checked, "by_k": {str(k): v for k, v in res.items()}}


# --------------------------------------------------------------------------------------------
# goldens
# --------------------------------------------------------------------------------------------

def fl(t):
    return [float(v) for v in t.detach().float().reshape(-1).cpu().tolist()]


def write_goldens(target, dr, embed_w, heldout_ids, out_dir, meta, device, log, cases_spec):
    os.makedirs(out_dir, exist_ok=True)
    base = "dflash_kvq-code-tiny"
    k = 8
    rows_all, cases = [], []
    ids_l = [int(x) for x in dr.cfg["dflash_config"]["target_layer_ids"]]
    for ci, (name, start, L) in enumerate(cases_spec):
        ctx = heldout_ids[start:start + L]
        logits_t, feats = target.logits_and_features(torch.tensor([ctx], device=device))
        top2 = logits_t[0, -1].topk(2)
        bonus = int(top2.indices[0])
        lg, hid, c = draft_block_logits(dr, embed_w, feats[0], bonus, k, return_hidden=True)
        rows_all.append(lg.float().cpu())
        t8 = lg.topk(8, dim=-1)
        t2 = lg.topk(2, dim=-1)
        margins = (t2.values[:, 0] - t2.values[:, 1])
        # localization aids at the last context position
        S = L
        cos, sin = rope_cos_sin(torch.tensor([[S - 1]], device=device), dr.d, dr.theta)
        layers_kv = []
        for li, layer in enumerate(dr.model.layers):
            kk, vv = layer_context_kv(dr, layer, c[S - 1:S][None], cos, sin)
            layers_kv.append({"layer": li, "k_after_k_norm_and_rope": fl(kk[0, 0]), "v": fl(vv[0, 0])})
        Ht = dr.cfg["dflash_config"]["target_hidden_size"]
        tl = []
        for j, l in enumerate(ids_l):
            h = feats[0, S - 1, j * Ht:(j + 1) * Ht]
            tl.append({"target_layer": l, "rms": float(h.pow(2).mean().sqrt()), "first8": fl(h[:8])})
        var = {}
        for kk_ in (2, 4):
            var[str(kk_)] = draft_block_logits(dr, embed_w, feats[0], bonus, kk_).argmax(-1).tolist()
        cases.append({
            "name": name, "heldout_token_offset": start, "context_len": L, "context_ids": [int(x) for x in ctx],
            "bonus_id": bonus, "bonus_position": L,
            "bonus_top1_top2_margin": float(top2.values[0] - top2.values[1]),
            "k": k, "block_ids": [bonus] + [None] * k, "block_positions": list(range(L, L + k + 1)),
            "draft_ids": lg.argmax(-1).tolist(),
            "top8_ids": t8.indices.tolist(), "top8_logits": [fl(r) for r in t8.values],
            "min_top1_top2_margin": float(margins.min()), "max_abs_logit": float(lg.abs().max()),
            "logits_bin_index": ci,
            "draft_ids_other_k": var,
            "target_layer_outputs_last_context_position": tl,
            "fused_context_feature_last_position": fl(c[S - 1]),
            "drafter_context_kv_last_position": layers_kv,
            "drafter_context_kv_layout": "per drafter layer: [kv_head][head_dim] flattened",
            "drafter_final_normed_hidden_row1": fl(hid[1]),
        })
        log(f"[goldens] {name}: ctx {L}, bonus {bonus}, drafts {cases[-1]['draft_ids']}, "
            f"min margin {cases[-1]['min_top1_top2_margin']:.4f}")
    arr = torch.stack(rows_all).numpy().astype("<f4")
    binname = f"{base}_logits.bin"
    arr.tofile(os.path.join(out_dir, binname))
    tcase = cases_spec[1]
    _, _, trace = spec_run(target, dr, embed_w, heldout_ids[tcase[1]:tcase[1] + tcase[2]], 4, 6, device, trace=True)
    doc = dict(meta)
    doc.update({
        "logits_file": binname, "logits_shape": list(arr.shape), "logits_dtype": "float32",
        "byte_order": "little",
        "logits_layout": "[case, mask row j = 1..k, vocab]: row j drafts the token at position context_len + j",
        "cases": cases,
        "spec_trace": {"case": tcase[0], "k": 4, "steps": trace,
                       "rule": "greedy: accepted_drafts = longest prefix with drafts[i] == target_greedy[i]; "
                               "next bonus = target_greedy[accepted_drafts]; the context grows by "
                               "[bonus] + drafts[:accepted_drafts]"},
    })
    with open(os.path.join(out_dir, f"{base}.json"), "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    return os.path.join(out_dir, f"{base}.json")


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=TARGET_DIR)
    ap.add_argument("--out", default="models/kvq-code-tiny-dflash")
    ap.add_argument("--goldens", default="tests/fixtures/goldens")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--target-layers", default="1,2,3,4,5", help="target_layer_ids (0-based decoder layers)")
    ap.add_argument("--init-from-target", default="3,4,5",
                    help="target layers copied into the drafter layers at init ('' = random init)")
    ap.add_argument("--init-from-drafter", default="",
                    help="start from this saved drafter directory (its model.safetensors, same shape) instead of "
                         "--init-from-target: continued training, e.g. for a longer block (--max-k)")
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--k-mix", default="2,3,4,5,6,7,8,8", help="k drawn uniformly from this list per step")
    ap.add_argument("--gamma", type=float, default=4.0, help="row weight exp(-(j-1)/gamma)")
    ap.add_argument("--sources", default="train:0,train:24,valA:0",
                    help="prompt sources STREAM:SAMPLED (sampled = tokens drawn at temperature 1 before the "
                         "greedy continuation)")
    ap.add_argument("--n-per", type=int, default=3500, help="generated sequences per source and prefix length")
    ap.add_argument("--n-val", type=int, default=256)
    ap.add_argument("--prefix-lens", default="16,32,64,128,192,256,320")
    ap.add_argument("--gen-len", type=int, default=56)
    ap.add_argument("--gen-batch", type=int, default=3500)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--anchors", type=int, default=40)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=150)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--minutes", type=float, default=3.2, help="training-loop wall-clock budget")
    ap.add_argument("--steps", type=int, default=0, help="fixed step count (else planned from speed)")
    ap.add_argument("--max-steps", type=int, default=20000)
    ap.add_argument("--state", default="",
                    help="resumable training: load this file (drafter, optimizer, step, random streams) when it "
                         "exists, and save it when --call-minutes runs out (then exit before the evaluation); "
                         "needs --steps, which fixes the learning-rate schedule across calls. The file holds the "
                         "drafter and AdamW's moments in fp32 (about 12 bytes per parameter: 32 MB for the default "
                         "drafter), more than the device tool returns in one file (16 MiB): split it to carry it")
    ap.add_argument("--call-minutes", type=float, default=0.0,
                    help="with --state: stop this call's training after this many minutes and save the state")
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-positions", type=int, default=100)
    ap.add_argument("--eval-steps", type=int, default=8, help="verify steps per held-out position")
    ap.add_argument("--eval-min-ctx", type=int, default=16)
    ap.add_argument("--eval-max-ctx", type=int, default=384)
    ap.add_argument("--lossless-checks", type=int, default=5)
    ap.add_argument("--max-files", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, seconds")
    ap.add_argument("--local-test", action="store_true",
                    help="no transformers/tokenizers/GPU needed: byte ids, plain-torch target, tiny sizes")
    args = ap.parse_args()
    if args.smoke or args.local_test:
        args.n_per, args.n_val, args.gen_len, args.gen_batch = 16, 16, 24, 32
        args.prefix_lens, args.batch, args.anchors = "16,40", 8, 8
        args.steps, args.eval_every, args.eval_positions, args.eval_steps = 12, 6, 3, 3
        args.eval_max_ctx, args.lossless_checks, args.warmup = 64, 2, 4
        args.max_files = 60
    t_start = time.time()
    logf = None
    os.makedirs(args.out, exist_ok=True)
    logf = open(os.path.join(args.out, "train_log.txt"), "w")

    def log(msg):
        print(msg, flush=True)
        logf.write(msg + "\n")
        logf.flush()

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.local_test else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # the target and the evaluation run in true fp32
        torch.backends.cudnn.allow_tf32 = False
    with open(os.path.join(args.target, "config.json")) as f:
        tcfg = json.load(f)
    dcfg = drafter_config(args, tcfg)
    layer_ids = dcfg["dflash_config"]["target_layer_ids"]
    versions = {"torch": torch.__version__, "python": sys.version.split()[0]}
    target_weights, _ = read_safetensors(os.path.join(args.target, "model.safetensors"))

    # ---- target + tokenizer ----
    if args.local_test:
        tok, target = None, RefTarget(args.target, device, layer_ids)
        heldout_ids = list(open(os.path.join(args.target, "heldout.txt"), "rb").read()[:20000])
        heldout_ids = [0] + heldout_ids
    else:
        import tokenizers
        import transformers
        versions.update({"transformers": transformers.__version__, "tokenizers": tokenizers.__version__})
        tok = tokenizers.Tokenizer.from_file(os.path.join(args.target, "tokenizer.json"))
        with open(os.path.join(args.target, "heldout.txt"), encoding="utf-8") as f:
            heldout_ids = tok.encode(f.read(), add_special_tokens=True).ids
        target = HFTarget(args.target, device, layer_ids)
        # cross-check transformers against the plain-torch reference (semantics of "layer output")
        ref = RefTarget(args.target, device, layer_ids)
        probe = torch.tensor([heldout_ids[:300]], device=device)
        lg_hf, outs_hf, hs_hf = target.all_layer_outputs(probe)
        lg_ref, outs_ref = ref.m.forward(probe)
        d_logits = float((lg_hf - lg_ref).abs().max())
        d_layers = [float((a - b).abs().max()) for a, b in zip(outs_hf, outs_ref)]
        d_hs = [float((outs_hf[l] - hs_hf[l + 1]).abs().max()) for l in range(len(outs_hf))]
        log(f"[check] HF vs Qwen3Ref on 300 held-out tokens: max|dlogits| {d_logits:.2e}, "
            f"max|dlayer_out| {max(d_layers):.2e}")
        log(f"[check] hook output of layer l vs output_hidden_states[l+1]: {['%.1e' % x for x in d_hs]} "
            f"(the last differs when transformers returns the post-norm state there)")
        versions["check_hf_vs_ref_max_abs_logits"] = d_logits
        versions["check_hf_vs_ref_max_abs_layer_out"] = max(d_layers)
        del ref
    embed_w = target.embed.detach().float()
    log(f"[env] device={device} {torch.cuda.get_device_name(0) if device.type == 'cuda' else ''} {versions} "
        f"target={target.name}")

    # ---- data: target's greedy continuations ----
    t0 = time.time()
    streams, data_info = token_streams(args, tok)
    data_info["tokens"] = {k: v.numel() for k, v in streams.items()}
    log(f"[data] {data_info}; heldout={len(heldout_ids)} in {time.time() - t0:.1f}s")
    prefix_lens = [int(x) for x in args.prefix_lens.split(",")]
    sources = []
    for item in args.sources.split(","):
        name, m = item.split(":")
        sources.append((name, int(m)))
    t0 = time.time()
    train_set, val_set = {}, {}
    for i, (name, m) in enumerate(sources):
        make_generated_set(target, streams[name], args.n_per, prefix_lens, args.gen_len, args.gen_batch,
                           args.seed + 10 * i, device, log, train_set, m, f"train[{name}]")
    make_generated_set(target, streams["valB"], max(1, args.n_val // len(prefix_lens)), prefix_lens, args.gen_len,
                       args.gen_batch, args.seed + 1, device, log, val_set, 0, "val[valB]")
    data_info["sources"] = [f"{n}:{m}" for n, m in sources]
    t_gen = time.time() - t0
    n_gen = sum(v.shape[0] for v in train_set.values())
    log(f"[gen] {n_gen} train + {sum(v.shape[0] for v in val_set.values())} val sequences, "
        f"{n_gen * args.gen_len} generated train tokens, {t_gen:.1f}s")
    # the cached generation must equal the full-recompute greedy (checked on a few rows)
    P0 = prefix_lens[0]
    chk = train_set[P0][:4]  # first source must be greedy (sampled=0) for this check
    rec = RefTarget(args.target, device, layer_ids).greedy_generate(chk[:, :P0], 16) if not args.local_test \
        else chk[:, P0:P0 + 16]
    mism = int((rec != chk[:, P0:P0 + 16]).sum())
    log(f"[check] cached greedy vs recomputed greedy (Qwen3Ref), 4 rows x 16 tokens: {mism} mismatches")

    # ---- drafter ----
    dr = Drafter(dcfg).to(device)
    init_layers = [int(x) for x in args.init_from_target.split(",") if x.strip()]
    init_drafter(dr, target_weights, init_layers, args.seed, log)
    if args.init_from_drafter:
        prev, _ = read_safetensors(os.path.join(args.init_from_drafter, "model.safetensors"))
        dr.load_state_dict({n: t.float() for n, t in prev.items()}, strict=True)
        log(f"[init] every drafter weight <- {args.init_from_drafter}/model.safetensors (continued training)")
    dr.to(device)
    nparams = sum(p.numel() for p in dr.parameters())
    log(f"[drafter] {dcfg['num_hidden_layers']} layers, {nparams:,} parameters ({nparams * 2 / 1e6:.2f} MB bf16), "
        f"target_layer_ids {layer_ids}")
    decay = [p for n, p in dr.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in dr.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    k_mix = parse_k_mix(args.k_mix)
    rng = random.Random(args.seed)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    buckets = sorted(train_set)
    amp = dict(device_type=device.type, dtype=torch.bfloat16)

    @torch.no_grad()
    def validate():
        dr.eval()
        vg = torch.Generator(device=device).manual_seed(99)
        tot, taus, corr = 0.0, [], []
        for P in sorted(val_set):
            toks = val_set[P]
            for i in range(0, toks.shape[0], args.batch):
                tb = toks[i:i + args.batch]
                feats = target.features(tb)
                with torch.autocast(**amp):
                    loss, correct, tau = block_batch(dr, embed_w, feats, tb, P, args.max_k, args.anchors, vg,
                                                     args.gamma)
                tot += float(loss) * tb.shape[0]
                taus.append(tau.reshape(-1))
                corr.append(correct.reshape(-1, args.max_k).float())
        dr.train()
        n = sum(v.shape[0] for v in val_set.values())
        return tot / n, float(torch.cat(taus).mean()), fl(torch.cat(corr).mean(0))

    history = []
    planned = args.steps or args.max_steps
    start_step, resumed_seconds, calls = 0, 0.0, 1
    if args.state:
        if not args.steps:
            sys.exit("train_dflash.py: --state needs --steps (the schedule must not depend on one call's speed)")
        if os.path.exists(args.state):
            st = torch.load(args.state, map_location=device, weights_only=False)
            dr.load_state_dict(st["drafter"])
            opt.load_state_dict(st["optimizer"])
            start_step, history = st["step"], st["history"]
            resumed_seconds, calls = st["seconds"], st["calls"] + 1
            rng.setstate(st["rng"])
            gen.set_state(st["gen"].cpu() if hasattr(st["gen"], "cpu") else st["gen"])
            log(f"[resume] {args.state}: step {start_step}, {resumed_seconds:.0f} s trained in {calls - 1} call(s)")
    budget = args.minutes * 60
    t_train0 = time.time() - resumed_seconds
    step, run_loss = start_step, None
    t_call0 = time.time()
    dr.train()
    while True:
        if args.steps and step >= args.steps:
            break
        if args.state and args.call_minutes > 0 and time.time() - t_call0 > args.call_minutes * 60:
            torch.save({"drafter": dr.state_dict(), "optimizer": opt.state_dict(), "step": step,
                        "history": history, "seconds": time.time() - t_train0, "calls": calls,
                        "rng": rng.getstate(), "gen": gen.get_state()}, args.state)
            log(f"[state] saved {args.state} at step {step} of {args.steps} ({time.time() - t_train0:.0f} s "
                f"trained); run the same command again to go on")
            return
        el = time.time() - t_train0
        if not args.steps:
            if step == 100:
                planned = min(args.max_steps, int(budget / (el / 100)))
                log(f"[train] {el / 100 * 1000:.1f} ms/step -> planned {planned} steps in {budget:.0f}s")
            if step >= planned or (step > 100 and el > budget * 1.05):
                break
        P = buckets[rng.randrange(len(buckets))]
        toks_all = train_set[P]
        idx = torch.randint(0, toks_all.shape[0], (args.batch,), generator=gen, device=device) \
            if device.type == "cuda" else torch.randint(0, toks_all.shape[0], (args.batch,))
        tb = toks_all[idx]
        k = k_mix[rng.randrange(len(k_mix))]
        feats = target.features(tb)
        lr = lr_at(step, planned, args.lr, args.warmup, args.min_lr_frac)
        for gparam in opt.param_groups:
            gparam["lr"] = lr
        with torch.autocast(**amp):
            loss, _, tau = block_batch(dr, embed_w, feats, tb, P, k, args.anchors, gen, args.gamma)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(dr.parameters(), 1.0)
        opt.step()
        step += 1
        lv = float(loss.detach()) if step % 25 == 0 or step < 5 else None
        if lv is not None:
            run_loss = lv if run_loss is None else 0.8 * run_loss + 0.2 * lv
        if step % args.eval_every == 0:
            vl, vt, vacc = validate()
            history.append({"step": step, "train_loss": run_loss, "val_loss": vl, "val_tau_k8": vt,
                            "seconds": time.time() - t_train0})
            log(f"[train] step {step} lr {lr:.2e} train {run_loss:.4f} val {vl:.4f} val tau(k={args.max_k}) {vt:.3f} "
                f"row acc {[round(a, 3) for a in vacc]} ({time.time() - t_train0:.0f}s)")
    train_time = time.time() - t_train0
    vl, vt, vacc = validate()
    history.append({"step": step, "train_loss": run_loss, "val_loss": vl, "val_tau_k8": vt, "seconds": train_time})
    log(f"[train] done: {step} steps in {train_time:.1f}s; final val loss {vl:.4f}, val tau(k={args.max_k}) {vt:.3f}, "
        f"row acc {[round(a, 3) for a in vacc]}")

    # ---- save ----
    state = {n: p for n, p in dr.state_dict().items()}
    meta = {"format": "pt", "architecture": ARCH, "target": "kvq-code-tiny"}
    write_safetensors_bf16(os.path.join(args.out, "model.safetensors"), state, meta)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(dcfg, f, indent=2)
        f.write("\n")

    # ---- evaluate the saved file (bf16 weights upcast to fp32) ----
    del opt, train_set
    if device.type == "cuda":
        torch.cuda.empty_cache()
    saved, _ = read_safetensors(os.path.join(args.out, "model.safetensors"))
    dr32 = Drafter(dcfg)
    missing = dr32.load_state_dict(saved, strict=True)
    dr32 = dr32.to(device).float().eval()
    t0 = time.time()
    ev = evaluate(target, dr32, embed_w, heldout_ids, args, device, log)
    t_eval = time.time() - t0

    # ---- goldens (CPU, fp32, transformers eager) ----
    t0 = time.time()
    cpu = torch.device("cpu")
    if args.local_test:
        gtarget = RefTarget(args.target, cpu, layer_ids)
    else:
        gtarget = HFTarget(args.target, cpu, layer_ids, attn="eager")
    dr_cpu = Drafter(dcfg)
    dr_cpu.load_state_dict(saved, strict=True)
    dr_cpu = dr_cpu.float().eval()
    gmeta = {
        "drafter": "kvq-code-tiny-dflash", "drafter_path": args.out if not (args.smoke or args.local_test)
        else "models/kvq-code-tiny-dflash", "target_path": TARGET_DIR,
        "files_sha256": {"drafter model.safetensors": sha256_file(os.path.join(args.out, "model.safetensors")),
                         "drafter config.json": sha256_file(os.path.join(args.out, "config.json")),
                         "target model.safetensors": sha256_file(os.path.join(args.target, "model.safetensors"))},
        "compute": "float32 on the CPU: drafter and target weights upcast from their saved bf16; target = "
                   f"{gtarget.name}, whole context recomputed (no cache); drafter = draft_block_logits() in "
                   "tools/train_dflash.py (one block, non-causal: every block row sees every context position "
                   "and every block row)",
        "target_layer_ids": layer_ids,
        "context": "context_ids = heldout ids [offset, offset+context_len) where heldout ids = "
                   "tokenizer.encode(models/kvq-code-tiny/heldout.txt, add_special_tokens=True); positions "
                   "0..context_len-1; bonus_id = argmax of the target's logits at the last context position, "
                   "placed at position context_len; mask rows at context_len+1..context_len+k",
        "versions": versions,
    }
    n_ids = len(heldout_ids)
    gcases = [("ctx17", 0, 17), ("ctx40", min(2000, n_ids // 3), 40), ("ctx100", min(20000, n_ids // 2), 100)]
    if args.local_test or args.smoke:
        gcases = [("ctx17", 0, 17), ("ctx40", 200, 40), ("ctx100", 1000, 100)]
    gpath = write_goldens(gtarget, dr_cpu, gtarget.embed.detach().float(), heldout_ids, args.goldens, gmeta, cpu,
                          log, gcases)
    t_gold = time.time() - t0
    log(f"[goldens] {gpath} in {t_gold:.1f}s")

    # ---- summary + README ----
    summary = {
        "architecture": ARCH, "parameters": nparams, "layers": dcfg["num_hidden_layers"],
        "target_layer_ids": layer_ids, "init_from_target_layers": init_layers,
        "init_from_drafter": args.init_from_drafter,
        "seed": args.seed, "argv": sys.argv[1:],
        "data": dict(data_info, prefix_lens=prefix_lens, gen_len=args.gen_len, train_sequences=n_gen,
                     val_sequences=sum(v.shape[0] for v in val_set.values()),
                     generated_train_tokens=n_gen * args.gen_len, generation_seconds=t_gen),
        "training": {"n_per": args.n_per, "steps": step, "calls": calls, "planned_steps": planned, "seconds": train_time, "batch": args.batch,
                     "anchors_per_sequence": args.anchors, "k_mix": k_mix, "gamma": args.gamma, "lr": args.lr,
                     "warmup": args.warmup, "min_lr_frac": args.min_lr_frac, "weight_decay": args.weight_decay,
                     "final_val_loss": vl, "final_val_tau_k8_teacher_forced": vt, "final_val_row_accuracy_k8": vacc,
                     "history": history},
        "eval_heldout_greedy_speculative": ev, "eval_seconds": t_eval, "goldens_seconds": t_gold,
        "versions": versions, "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "script_seconds": time.time() - t_start,
    }
    with open(os.path.join(args.out, "train_summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
        f.write("\n")
    write_readme(args, dcfg, summary)
    log(f"[done] {args.out}: script wall time {time.time() - t_start:.1f}s")
    print("SUMMARY " + json.dumps({"steps": step, "train_s": round(train_time, 1),
                                   "tau": {k: round(v["mean_accepted_length_per_step"], 3)
                                           for k, v in ev["by_k"].items()},
                                   "val_tau_k8": round(vt, 3), "wall_s": round(time.time() - t_start, 1)}))


def write_readme(args, dcfg, s):
    ev = s["eval_heldout_greedy_speculative"]
    tr = s["training"]
    rows = "\n".join(f"| {k} | {v['mean_accepted_length_per_step']:.3f} | {v['mean_over_positions']:.3f} | "
                     f"{v['verify_steps']} | {v['histogram_accepted_length_1_to_k+1']} |"
                     for k, v in ev["by_k"].items())
    hist = "\n".join(f"    step {h['step']:6d}  train {h['train_loss'] if h['train_loss'] is not None else float('nan'):.4f}"
                     f"  val {h['val_loss']:.4f}  val tau(k={dcfg['dflash_config']['max_speculative_tokens']}) {h['val_tau_k8']:.3f}  ({h['seconds']:.0f} s)"
                     for h in tr["history"])
    files = []
    for name in sorted(os.listdir(args.out)):
        if name in ("README.md", "train_log.txt"):  # the log is still being written
            continue
        p = os.path.join(args.out, name)
        files.append(f"    {sha256_file(p)}  {name} ({os.path.getsize(p):,} bytes)")
    dc = dcfg["dflash_config"]
    init_text = (f"every weight from the drafter in `{s['init_from_drafter']}` (continued training with "
                 f"this block length)." if s.get("init_from_drafter") else
                 f"drafter layers copied from target layers {s['init_from_target_layers']} (and `model.norm`);\n"
                 "  `fc`, `hidden_norm`, `mask_embedding` fresh.")
    calls_note = (f", in {tr['calls']} calls resumed from a saved state (`--state`; each call regenerates the "
                  f"data from the same seeds)") if tr.get("calls", 1) > 1 else ""
    text = f"""# kvq-code-tiny-dflash: a DFlash (block-diffusion) drafter for kvq-code-tiny

A {s['layers']}-layer drafter ({s['parameters']:,} parameters, bf16 safetensors) that proposes k tokens in
one non-causal forward pass, conditioned on the hidden states of its target, `models/kvq-code-tiny`.
Its format and exact inference math are in `docs/notes/dflash.md`; the PyTorch reference is
`draft_block_logits()` in `tools/train_dflash.py`. It has no embedding or LM head of its own: both are
the target's (tied). A block is 1 + k tokens (the bonus token and k mask rows), k = 1 ..
{dc['max_speculative_tokens']}; it was trained with k in {dc['trained_speculative_tokens']}, and k = {', '.join(ev['by_k'])}
are evaluated below.

## Format (config.json)

- `architectures` = `["{ARCH}"]`; every layer is a Qwen3 decoder layer (hidden {dcfg['hidden_size']},
  {dcfg['num_attention_heads']} query / {dcfg['num_key_value_heads']} KV heads, head_dim {dcfg['head_dim']},
  intermediate {dcfg['intermediate_size']}, q/k RMSNorm, RoPE theta {dcfg['rope_parameters']['rope_theta']}),
  attention non-causal over [context, block].
- `dflash_config.target_layer_ids` = {dc['target_layer_ids']}: outputs of those target decoder layers
  (before the final norm) are concatenated, projected by `fc.weight`
  [{dcfg['hidden_size']}, {len(dc['target_layer_ids']) * dc['target_hidden_size']}] and normalised by
  `hidden_norm.weight`; each drafter layer turns that feature into context K/V with its own
  k_proj/k_norm/RoPE and v_proj.
- mask rows are embedded by the learned vector `mask_embedding` [{dcfg['hidden_size']}] (no mask token id).

## Training

- Command: `python3 tools/train_dflash.py {' '.join(s['argv'])}` (seed {s['seed']}).
- Data: the target's own greedy continuations, {s['data']['train_sequences']:,} sequences
  ({s['data']['generated_train_tokens']:,} generated tokens, {s['data']['generation_seconds']:.0f} s). Text:
  the CPython {s['data']['python']} standard library under `{s['data']['stdlib']}`, split as
  tools/train_default_model.py splits it ({s['data']['train_files']} training files; the
  {s['data']['val_files']} validation files, which the target never trained on, are cut in two:
  odd ones ("valA", {s['data']['val_prompt_files']} files) give prompts, even ones ("valB",
  {s['data']['val_eval_files']} files) the drafter's validation; held-out files are not used).
  Prompt sources `STREAM:SAMPLED` = {s['data']['sources']}, {s['training']['n_per']} sequences per source
  and prompt length: a random window of STREAM of P tokens (P in {s['data']['prefix_lens']}), then SAMPLED
  tokens drawn from the target at temperature 1 (contexts it has not memorised), then
  {s['data']['gen_len']} greedy tokens of the frozen target (fp32, transformers, KV cache). Loss only on
  blocks anchored in the greedy part. Validation: {s['data']['val_sequences']} greedy sequences from valB.
- Blocks: {tr['anchors_per_sequence']} random anchors a per sequence among the generated tokens;
  block = [token at a, mask x k] at positions a..a+k; it sees the target features of positions < a
  and its own rows (non-causal), never other blocks; row j is trained to predict the target's greedy
  token at a+j with weight exp(-(j-1)/{tr['gamma']}); k drawn per step from {tr['k_mix']}.
- Init: {init_text} AdamW (0.9, 0.95), lr {tr['lr']} with {tr['warmup']}
  warm-up steps and cosine decay to {tr['min_lr_frac']} x, weight decay {tr['weight_decay']} on matrices,
  grad clip 1.0, bf16 autocast, batch {tr['batch']} sequences. The target stays frozen in fp32; its
  hidden states are recomputed at each step.
- {tr['steps']} steps in {tr['seconds']:.1f} s on {s['device']}{calls_note}; torch {s['versions'].get('torch')},
  transformers {s['versions'].get('transformers')}, tokenizers {s['versions'].get('tokenizers')}.
  Whole script {s['script_seconds']:.0f} s.

Loss history (weighted block cross-entropy; val tau = mean accepted length of teacher-forced
k = {dc['max_speculative_tokens']} blocks on the validation sequences):

{hist}

## Acceptance (held-out, greedy speculative decoding against the target)

`heldout.txt` of kvq-code-tiny, tokenised with BOS; {ev['positions']} random windows of
{ev['context_lengths'][0]}..{ev['context_lengths'][1]} tokens as contexts (seed {ev['seed']}); from each,
{ev['steps_per_position']} verify steps: the drafter proposes k tokens after the bonus token, one target
forward verifies them, the longest agreeing prefix is kept plus the target's own next token. Accepted
length = accepted drafts + 1. fp32 (TF32 off), drafter weights = the saved bf16 upcast. The output was
checked equal to plain greedy decoding on {ev['lossless_checked_positions']} positions.

| k | mean accepted length per verify step | mean over positions | verify steps | histogram (1..k+1) |
|---|---|---|---|---|
{rows}

## Files (sha256)

{chr(10).join(files)}

`train_log.txt` is the script's log. Goldens for kvq's C++ implementation: `tests/fixtures/goldens/dflash_kvq-code-tiny.json` and
`dflash_kvq-code-tiny_logits.bin`.

## License and origin

Trained from scratch by this repository's script on text generated by kvq-code-tiny from Python
standard-library prompts (PSF License; see `models/kvq-code-tiny/LICENSE-PSF.txt`). Method after
DFlash (Chen, Liang, Liu: "DFlash: Block Diffusion for Flash Speculative Decoding", arXiv:2602.06036);
no code or weights of theirs are used.
"""
    with open(os.path.join(args.out, "README.md"), "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main()
