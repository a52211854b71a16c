# @title The parameter rules (machinery)
import dataclasses
import importlib.metadata
import math
import os

PRECISIONS, DRIVE = ("fp8", "bf16", "fp16", "fp32"), "/content/drive"  # Colab mounts Drive there


def integer(low):
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= low


def writable(path, create=True):  # may we write `path` (or create it)? On Drive: once mounted
    folder = os.path.dirname(os.path.abspath(path))
    while create and not os.path.exists(folder):
        folder = os.path.dirname(folder)
    mounted = not os.path.abspath(path).startswith(DRIVE) or os.path.ismount(DRIVE)
    return mounted and os.path.isdir(folder) and os.access(folder, os.W_OK)


FILE = "None or a file path in an existing folder this notebook may write to"
FOLDER = "None or a folder this notebook may write to (or create); on Google Drive, mount it"
FOLDER += ' first: from google.colab import drive; drive.mount("/content/drive")'
RULES = {  # NAME: (test, rule); a name not listed here must be a positive integer
    "PRECISION": (lambda v: v in ("auto", *PRECISIONS), "one of auto, fp8, bf16, fp16, fp32"),
    "SEED": (integer(0), "an integer >= 0"),
    "LEARNING_RATE": (lambda v: isinstance(v, float | int) and 0 < v < math.inf, "a number > 0"),
    "FP8_FORMAT": (lambda v: v in ("HYBRID", "E4M3"), "HYBRID or E4M3 (TE refuses pure E5M2)"),
    "AMAX_HISTORY_LEN": (integer(2), "an integer >= 2 (TE takes 1, then clears the row read here)"),
    "AMAX_COMPUTE_ALGO": (lambda v: v in ("max", "most_recent"), "max or most_recent"),
    "FP8_MARGIN": (integer(0), "an integer >= 0 (the scale is divided by 2**margin)"),
    "PROMPT_LEN": (integer(2), "an integer >= 2 (two tokens show the stride)"),
    "RESULTS_JSON": (lambda v: v is None or isinstance(v, str) and writable(v, create=False), FILE),
    "TE_WHEEL_DIR": (lambda v: v is None or isinstance(v, str) and writable(f"{v}/wheel"), FOLDER),
}
RELATIONS = {  # between sizes: True, or the rule for the first size named
    ("MAX_STRIDE", "VOCAB_SIZE"): lambda s, v: s < v or f"smaller than VOCAB_SIZE={v}",
    ("D_MODEL", "N_HEADS"): lambda d, h: d % h == 0 or f"divisible by N_HEADS={h}",
    ("GEN_TOKENS", "SEQ_LEN", "PROMPT_LEN"): lambda g, s, n: (
        g <= s - n or f"at most SEQ_LEN - PROMPT_LEN = {s - n}"
    ),
}


# @title The check: every broken rule named at once; the imports (machinery)
import json
import pickle
import time

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

RUN_STARTED = time.perf_counter()
PARAMETER_NAMES = """PRECISION SEED VOCAB_SIZE MAX_STRIDE SEQ_LEN D_MODEL N_LAYERS N_HEADS
FFN_HIDDEN BATCH_SIZE TRAIN_STEPS LEARNING_RATE FP8_FORMAT AMAX_HISTORY_LEN AMAX_COMPUTE_ALGO
FP8_MARGIN EVAL_PROMPTS PROMPT_LEN GEN_TOKENS RESULTS_JSON TE_WHEEL_DIR""".split()
Config = dataclasses.make_dataclass("Config", [n.lower() for n in PARAMETER_NAMES], frozen=True)


def check_parameters(p):  # NAME: value as a Config, or a ValueError naming every broken rule
    rules = {n: RULES.get(n, (integer(1), "a positive integer")) for n in PARAMETER_NAMES}
    broken = {n: rule for n, (ok, rule) in rules.items() if not ok(p[n])}
    for names, holds in RELATIONS.items():  # once each size a relation reads is sane
        if not broken.keys() & set(names) and (rule := holds(*(p[n] for n in names))) is not True:
            broken[names[0]] = rule
    if broken:
        problems = [f"{n}={p[n]!r}: must be {rule}" for n, rule in broken.items()]
        raise ValueError("Invalid parameters:\n  " + "\n  ".join(problems))
    return Config(*(p[name] for name in PARAMETER_NAMES))


def check_torch(version):  # before torch 2.8, torch._scaled_mm (our FP8 GEMM) has no CPU kernel
    if tuple(int(part) for part in version.split(".")[:2]) < (2, 8):
        raise RuntimeError(f"torch {version}: this notebook needs torch 2.8+ (FP8 GEMMs on a CPU)")


# @title FP8's two formats and their layouts, from torch.finfo (machinery)
FP8_DTYPES = {"E4M3": torch.float8_e4m3fn, "E5M2": torch.float8_e5m2}
FP8_MAX = {fmt: torch.finfo(dtype).max for fmt, dtype in FP8_DTYPES.items()}  # 448, 57344


def fp8_layout(fmt):  # bits; the largest, smallest normal and subnormal values; where values flush
    info = torch.finfo(FP8_DTYPES[fmt])
    mantissa = round(-math.log2(info.eps))  # eps = 2**-mantissa bits
    subnormal = info.smallest_normal * info.eps  # the last mantissa bit at the lowest exponent
    flush = subnormal / 2  # below this (and at it: ties round to even) a value becomes 0
    layout = {"bits": f"1/{7 - mantissa}/{mantissa}", "max": info.max, "normal": info.tiny}
    return layout | {"subnormal": subnormal, "flush": flush, "span": math.log2(info.max / flush)}


def quantize(x, scale, fmt):
    """x * scale cast to FP8, saturating at ±fp8_max as TE's casts do; and amax(x)."""
    x_fp8 = (x.detach().float() * scale).clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(FP8_DTYPES[fmt])
    return x_fp8, x.detach().abs().max().float()


def relative_difference(reference, other):
    return ((reference - other).float().norm() / reference.float().norm()).item()


def update_scales(amax_history, scale, fp8_max, margin=0, algo="max"):
    """TE's delayed-scaling update, in place: one column per tensor, row 0 this step's amax."""
    window = torch.where(amax_history.isnan(), 0.0, amax_history)  # the kernel's fmaxf skips NaN
    amax = window.max(dim=0).values if algo == "max" else amax_history[0]
    new_scale = torch.full_like(amax, fp8_max * 2.0**-margin) / amax  # tensor / tensor: exact
    new_scale = torch.where(amax.isfinite() & (amax > 0), new_scale, scale)
    rolled = amax_history.roll(-1, dims=0)  # row i <- row i + 1; this step's amax -> row -1
    rolled[0] = 0.0
    cast = amax_history[0] != 0  # a tensor not cast this step keeps its scale and history
    scale.copy_(torch.where(cast, new_scale.clamp(max=torch.finfo(torch.float32).max), scale))
    amax_history.copy_(torch.where(cast, rolled, amax_history))


# @title TE's release, its needs and time limits; TE pointed at torch's cuDNN (machinery)
import ctypes
import glob
import platform
import re
import subprocess
import sys
import tempfile

TE_VERSION = "2.20.2"  # the release this notebook is written for
TE_PIP_SPEC, TE_EXTENSION = f"transformer_engine[pytorch]=={TE_VERSION}", "transformer_engine_torch"
TE_MIN_VERSION, TE_MIN_CAPABILITY, TE_MIN_CUDNN = (2, 9), (8, 0), (9, 12)  # te.autocast: 2.9+
EXTENSION_FILES, GIB_PER_COMPILER = 33, 1.5  # the C++ files pip compiles; g++'s peak memory
COMPILE_CPU_MINUTES = EXTENSION_FILES * 0.8  # measured in the Colab-like setup: 0.8 a file
COMPILE_FLOOR_S = 15 * 60  # 10x pybind.cpp's 1.4 min alone here; larger files: one core each
DOWNLOAD_LIMIT_S = 15 * 60  # for each pip call that downloads: ninja; TE's core (729 MB)


def use_pips_cudnn():  # TE at pip's cuDNN: CUDNN_PATH; libraries loaded before Colab's older 9.8
    for wheel in importlib.metadata.distributions():  # the first cuDNN wheel; None without one
        if wheel.name.startswith("nvidia-cudnn-cu"):
            cudnn_dir = os.environ["CUDNN_PATH"] = str(wheel.locate_file("nvidia/cudnn"))
            for library in glob.glob(f"{cudnn_dir}/lib/libcudnn*.so*"):
                ctypes.CDLL(library)
            return cudnn_dir


CUDNN_DIR = use_pips_cudnn()  # on every runtime: a process that imports TE needs it first


# @title Import TE where it can run; its reason kept where it cannot (machinery)
def import_te():  # TE's PyTorch API, DelayedScaling and Format; or Nones and why TE is not usable
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < TE_MIN_CAPABILITY:
        return None, None, None, "TE needs a CUDA GPU of compute capability 8.0+"
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import DelayedScaling, Format
    except Exception as exc:  # noqa: BLE001 not installed, a library missing, TE's own checks
        return None, None, None, f"{type(exc).__name__}: {exc}"
    if not hasattr(te, "autocast"):  # TE 2.9 renamed fp8_autocast(fp8_recipe=...) to it
        return None, None, None, "TE older than 2.9 (no te.autocast)"
    return te, DelayedScaling, Format, None


te, DelayedScaling, Format, TE_ERROR = import_te()
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
te_is = f"not usable ({TE_ERROR})" if TE_ERROR else importlib.metadata.version("transformer_engine")
print(f"Python {platform.python_version()}, torch {torch.__version__}, TE {te_is}")


def make_stride_batch(n, length, vocab_size, max_stride, generator):
    """n sequences of `length` tokens and their strides: (n, length), (n,)."""
    kw = {"generator": generator, "device": generator.device}
    start = torch.randint(0, vocab_size, (n, 1), **kw)
    stride = torch.randint(1, max_stride + 1, (n, 1), **kw)
    return (start + stride * torch.arange(length, device=kw["device"])) % vocab_size, stride[:, 0]


def training_batch(cfg, generator):
    """BATCH_SIZE sequences of SEQ_LEN + 1 tokens: SEQ_LEN inputs, each followed by its target."""
    shape = cfg.batch_size, cfg.seq_len + 1
    return make_stride_batch(*shape, cfg.vocab_size, cfg.max_stride, generator)[0]


import torch
from torch import nn  # and te: import transformer_engine.pytorch as te (CPU: above)


class CausalLM(nn.Module):
    def __init__(self, cfg, device, params_dtype=torch.float32, fp8_head=False):
        super().__init__()
        self.vocab_size, kw = cfg.vocab_size, {"params_dtype": params_dtype, "device": device}
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model, device=device)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model, device=device)
        for emb in (self.tok_emb, self.pos_emb):
            nn.init.normal_(emb.weight, 0.0, 0.023)  # TE's default init, like the layers'
        self.layers = nn.ModuleList(
            te.TransformerLayer(
                cfg.d_model,
                cfg.ffn_hidden,
                cfg.n_heads,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                self_attn_mask_type="causal",  # position t attends to positions <= t
                name=f"layers.{i}",  # TE's debug tools (10.11) name its GEMMs from it
                attn_input_format="bshd",  # our tensors are (batch, seq, hidden)
                fuse_qkv_params=True,  # one QKV weight, laid out [q; k; v]
                qkv_weight_interleaved=False,
                **kw,
            )
            for i in range(cfg.n_layers)
        )
        self.final_norm = te.LayerNorm(cfg.d_model, dtype=params_dtype, device=device)
        self.fp8_head = fp8_head  # False: the head outside FP8; True (10.2): padded for TE's GEMMs
        vocab = -(-cfg.vocab_size // 16) * 16 if fp8_head else cfg.vocab_size  # rounded up to 16s
        self.head = te.Linear(cfg.d_model, vocab, **kw)

    def forward(self, idx, is_first_microbatch=None):  # idx: (B, T) token ids; the flag: 10.12
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            x = layer(x, is_first_microbatch=is_first_microbatch)  # (B, T, D): "bshd"
        if self.fp8_head:  # the padding's logits never reach the loss or generation
            return self.head(self.final_norm(x))[..., : self.vocab_size]
        recipe = te.quantization.FP8GlobalStateManager.get_fp8_recipe()  # the surrounding one,
        with te.autocast(enabled=False, recipe=recipe):  # if any: else TE files its default there
            return self.head(self.final_norm(x))  # (B, T, vocab), in the surrounding precision


# @title What the stand-in's twins of TE's modules share (stand-in)
import contextvars
import types

ACTIVE_FP8 = contextvars.ContextVar("the stand-in's FP8 autocast", default=None)


def te_parameter(*shape, fill=None, device=None, params_dtype=torch.float32):
    p = torch.empty(*shape, device=device, dtype=params_dtype)  # TE's init: normal(0, 0.023),
    return nn.Parameter(p.normal_(0.0, 0.023) if fill is None else p.fill_(fill))  # or constants


class TwinModule(nn.Module):  # TE's fp8_meta, FP8 GEMMs in the stand-in's autocast, fused LayerNorm
    def __init__(self, num_gemms, width, eps=None, **kw):
        super().__init__()
        self.fp8_meta, self.num_gemms, self.eps = {}, num_gemms, eps
        if eps is not None:
            self.layer_norm_weight = te_parameter(width, fill=1.0, **kw)
            self.layer_norm_bias = te_parameter(width, fill=0.0, **kw)

    def norm(self, x):
        if self.eps is None:
            return x
        return F.layer_norm(x, x.shape[-1:], self.layer_norm_weight, self.layer_norm_bias, self.eps)

    def gemm(self, x, weight, bias, index, is_first_microbatch=None):  # the flag: as TE's (10.12)
        fp8, self.is_first_microbatch = ACTIVE_FP8.get(), is_first_microbatch  # fp8: None outside
        self.fp8_meta["fp8_checkpoint"] = fp8 is not None  # as TE's, at every forward (10.7)
        return fp8.linear(self, x, weight, bias, index) if fp8 else F.linear(x, weight, bias)


TWIN_SETTINGS = {"hidden_dropout": 0.0, "attention_dropout": 0.0, "self_attn_mask_type": "causal"}
TWIN_SETTINGS |= {"attn_input_format": "bshd", "fuse_qkv_params": True}
TWIN_SETTINGS |= {"qkv_weight_interleaved": False}  # the keywords of section 6.1's layers


# @title The twins of te.Linear, te.LayerNormLinear, te.LayerNormMLP, te.TransformerLayer (stand-in)
class TwinLinear(TwinModule):  # te.Linear; with `eps`, te.LayerNormLinear (a LayerNorm fused in)
    def __init__(self, in_features, out_features, eps=None, **kw):
        super().__init__(1, in_features, eps, **kw)
        self.weight = te_parameter(out_features, in_features, **kw)
        self.bias = te_parameter(out_features, fill=0.0, **kw)

    def forward(self, x, is_first_microbatch=None):
        return self.gemm(self.norm(x), self.weight, self.bias, 0, is_first_microbatch)


class TwinLayerNormMLP(TwinModule):  # te.LayerNormMLP: LayerNorm, fc1, GELU (tanh, as TE's), fc2
    def __init__(self, hidden, ffn_hidden, eps, **kw):
        super().__init__(2, hidden, eps, **kw)
        self.fc1_weight = te_parameter(ffn_hidden, hidden, **kw)
        self.fc1_bias = te_parameter(ffn_hidden, fill=0.0, **kw)
        self.fc2_weight = te_parameter(hidden, ffn_hidden, **kw)
        self.fc2_bias = te_parameter(hidden, fill=0.0, **kw)

    def forward(self, x, is_first_microbatch=None):
        x = self.gemm(self.norm(x), self.fc1_weight, self.fc1_bias, 0, is_first_microbatch)
        x = F.gelu(x, approximate="tanh")
        return self.gemm(x, self.fc2_weight, self.fc2_bias, 1, is_first_microbatch)


class TwinTransformerLayer(nn.Module):  # te.TransformerLayer as in 6.1: pre-LN attention, MLP
    def __init__(self, hidden, ffn_hidden, heads, layernorm_epsilon=1e-5, **kw_and_settings):
        super().__init__()
        kw = {k: kw_and_settings.pop(k) for k in ("params_dtype", "device") if k in kw_and_settings}
        kw_and_settings.pop("name", None)  # for TE's debug tools (10.11); the stand-in logs its own
        if kw_and_settings != TWIN_SETTINGS:
            raise ValueError(f"the stand-in implements {TWIN_SETTINGS}, not {kw_and_settings}")
        self.heads, self.self_attention = heads, nn.Module()  # TE's names, as TE nests them
        self.self_attention.layernorm_qkv = TwinLinear(hidden, 3 * hidden, layernorm_epsilon, **kw)
        self.self_attention.proj = TwinLinear(hidden, hidden, **kw)
        self.layernorm_mlp = TwinLayerNormMLP(hidden, ffn_hidden, layernorm_epsilon, **kw)

    def forward(self, x, is_first_microbatch=None):  # x: (B, T, D)
        (B, T, D), first = x.shape, is_first_microbatch
        qkv = self.self_attention.layernorm_qkv(x, first).view(B, T, 3, self.heads, D // self.heads)
        q, k, v = qkv.transpose(1, 3).unbind(2)  # each (B, heads, T, D / heads)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, D / heads)
        x = x + self.self_attention.proj(y.transpose(1, 2).reshape(B, T, D), first)
        return x + self.layernorm_mlp(x, first)


# @title The FP8 reference: what each cast lost, as TE's debug tools compute it (stand-in)
REFERENCE_STATS = ("overflows%", "underflows%", "fp8_current_scaling_underflows%", "scale_inv")
REFERENCE_STATS += ("mse", "cur_amax", "dynamic_range")  # TE's names (10.11)
STATS_TAKEN = 2  # how many of them each cast takes: 2 by default, all in 10.11, none untracked


def cast_stats(x, x_fp8, scale, fmt):  # one cast's REFERENCE_STATS as TE's debug tools compute them
    x, fp8_max, nonzero = x.detach().float(), FP8_MAX[fmt], x.count_nonzero()
    a, percent = x.abs(), lambda count: count / x.numel() * 100  # as TE: count / numel * 100
    # TE's underflows%: the non-zero values cast to zero (FP8's zeros: no bit set but the sign)
    flushed = lambda q: percent(nonzero - (q.view(torch.uint8) << 1).count_nonzero())  # noqa: E731
    overflows = percent((a > fp8_max * scale.reciprocal()).sum())  # saturated
    if STATS_TAKEN < len(REFERENCE_STATS):  # the rest cost a quarter of a step: 10.11 takes them
        return torch.stack((overflows, flushed(x_fp8), *[torch.full_like(overflows, math.nan)] * 5))
    amax, back = a.max(), x_fp8.float() * scale.reciprocal()  # the values cast back
    now = (fp8_max / amax).clamp(max=torch.finfo().max) if 0 < amax < math.inf else 1.0  # as TE
    current = quantize(x, now, fmt)[0]  # current scaling's cast (TE: scale 1 at amax 0, inf, NaN)
    stats = overflows, flushed(x_fp8), flushed(current), 1 / scale, F.mse_loss(x, back)
    return torch.stack((*stats, amax, (amax / torch.where(a > 0, a, amax).min()).log2()))


# @title The FP8 reference: a GEMM on FP8 operands, and delayed scaling as an autograd function
import torch.distributed as dist


def fp8_formats(recipe):  # each direction's format: HYBRID is E4M3 forward and E5M2 for gradients
    return {"forward": "E4M3", "backward": "E5M2" if recipe.fp8_format.name == "HYBRID" else "E4M3"}


def fp8_matmul(a, a_inv, b, b_inv):  # FP8 values (M, K) @ (K, N), each with its 1 / scale, in FP32
    aligned = all(n % 16 == 0 for n in (*a.shape, b.shape[1]))
    if a.is_cuda and aligned and torch.cuda.get_device_capability() >= (8, 9):
        b = b.t().contiguous().t()  # column-major, as cuBLASLt wants the second operand
        return torch._scaled_mm(a.contiguous(), b, a_inv, b_inv, out_dtype=torch.float32)
    return (a.float() @ b.float()) * (a_inv * b_inv)  # as _scaled_mm, ~500x faster w/o AMX-FP16


def fp8_state(n, history_len, device):  # one direction's state in TE's layout, + its stats
    stats = torch.zeros(len(REFERENCE_STATS), n, device=device)
    ones, zeros = torch.ones(n, device=device), torch.zeros(history_len, n, device=device)
    return types.SimpleNamespace(scale=ones, amax_history=zeros, stats=stats)


class FP8Linear(torch.autograd.Function):  # y = x W^T + b; x, W cast to FP8 forward, dy backward
    @staticmethod
    def forward(ctx, x, weight, bias, module, index, fp8):
        state, x2d = module.fp8_meta["scaling_fwd"], x.reshape(-1, x.shape[-1])  # (tokens, in)
        x_fp8, x_inv = fp8.cast(x2d, state, 3 * index, "forward")  # slot 3k: GEMM k's input
        first, kept = module.is_first_microbatch, module.__dict__.setdefault("fp8_weights", {})
        if first is None or first or index not in kept:  # TE's linear.py: update_ws (10.12)
            cast = fp8.cast(weight, state, 3 * index + 1, "forward")  # 3k + 1: its weight
            kept |= {} if first is None else {index: cast}  # TE keeps its casts given the flag
        w_fp8, w_inv = cast if first is None else kept[index]
        if not x.is_cuda:  # the CPU's GEMM takes the FP8 values in FP32: convert them once, here
            x_fp8, w_fp8 = x_fp8.float(), w_fp8.float()
        ctx.save_for_backward(x_fp8, x_inv, w_fp8, w_inv)
        ctx.module, ctx.index, ctx.fp8, ctx.x_shape = module, index, fp8, x.shape
        return (fp8_matmul(x_fp8, x_inv, w_fp8.t(), w_inv) + bias).reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dy):
        x_fp8, x_inv, w_fp8, w_inv = ctx.saved_tensors
        dy2d, state = dy.reshape(-1, dy.shape[-1]), ctx.module.fp8_meta["scaling_bwd"]
        dy_fp8, dy_inv = ctx.fp8.cast(dy2d, state, 2 * ctx.index, "backward")  # slot 2k
        dx = fp8_matmul(dy_fp8, dy_inv, w_fp8, w_inv)  # (tokens, out) @ (out, in)
        dw = fp8_matmul(dy_fp8.t(), dy_inv, x_fp8, x_inv)  # (out, tokens) @ (tokens, in)
        if ctx.fp8.first_gemm == (ctx.module, ctx.index):  # the first GEMM's backward runs last:
            ctx.fp8.update("scaling_bwd", "backward")  # as TE: update them once all are done
        return dx.reshape(ctx.x_shape), dw, dy2d.sum(dim=0), None, None, None


# @title The FP8 reference: the bookkeeping of one autocast region, in TE's layout
class ReferenceFP8:  # the bookkeeping of one te.autocast(recipe=DelayedScaling(...)) region
    def __init__(self, recipe, group=None):
        self.recipe, self.group, self.modules, self.first_gemm = recipe, group, [], None
        self.formats, self.rule = fp8_formats(recipe), (recipe.margin, recipe.amax_compute_algo)

    def linear(self, module, x, weight, bias, index):
        meta, n, length = module.fp8_meta, module.num_gemms, self.recipe.amax_history_len
        if meta.get("recipe") != self.recipe:  # the first FP8 forward, or a new recipe: new state
            fwd, bwd = (fp8_state(k * n, length, weight.device) for k in (3, 2))
            meta.update(recipe=self.recipe, num_gemms=n, scaling_fwd=fwd, scaling_bwd=bwd)
        self.modules += [] if module in self.modules else [module]
        self.first_gemm = self.first_gemm or (module, index)
        return FP8Linear.apply(x, weight, bias, module, index, self)

    def cast(self, x, state, slot, direction):  # at the slot's scale; amax(x) to row 0, as TE
        x_fp8, amax = quantize(x, scale := state.scale[slot], fmt := self.formats[direction])
        state.amax_history[0, slot] = torch.maximum(state.amax_history[0, slot], amax)
        state.stats[:, slot] = cast_stats(x, x_fp8, scale, fmt) if STATS_TAKEN else math.nan
        return x_fp8, scale.reciprocal()  # a copy: the scale will change in place

    def update(self, key, direction):  # as TE: amaxes MAX-reduced in a group of 2+; the rule
        states, fp8_max = [m.fp8_meta[key] for m in self.modules], FP8_MAX[self.formats[direction]]
        reduce = self.recipe.reduce_amax and dist.is_initialized()  # then: more than one?
        if reduce and dist.get_world_size(self.group) > 1:
            newest = torch.cat([s.amax_history[0] for s in states])
            dist.all_reduce(newest, op=dist.ReduceOp.MAX, group=self.group)
            for s, amax in zip(states, newest.split([len(s.scale) for s in states]), strict=True):
                s.amax_history[0] = amax
        for s in states:
            update_scales(s.amax_history, s.scale, fp8_max, *self.rule)


# @title The stand-in's DelayedScaling and te.autocast, and the switch where TE is not usable
import contextlib
import enum
from unittest import mock

ReferenceFormat = enum.Enum("Format", ["E4M3", "HYBRID"], qualname="ReferenceFormat")  # pickled


@dataclasses.dataclass(frozen=True)
class ReferenceRecipe:  # the fields of TE's DelayedScaling that the reference honours
    fp8_format: enum.Enum = ReferenceFormat.HYBRID  # TE's Format, without pure E5M2 (refused)
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    margin: int = 0
    reduce_amax: bool = True  # across amax_reduction_group, where torch.distributed runs


@contextlib.contextmanager
def reference_autocast(enabled=True, recipe=None, amax_reduction_group=None):  # te.autocast's twin
    fp8 = recipe if enabled else None  # a recipe that does its own GEMMs (10.8's) runs as it is
    if enabled and not hasattr(recipe, "linear"):
        fp8 = ReferenceFP8(recipe or ReferenceRecipe(), amax_reduction_group)
    token = ACTIVE_FP8.set(fp8)
    try:
        yield
    finally:
        ACTIVE_FP8.reset(token)
    if isinstance(fp8, ReferenceFP8) and torch.is_grad_enabled():  # as TE (autocast_exit):
        fp8.update("scaling_fwd", "forward")  # the forward scales


def using(modules):  # `te` means these modules inside: the stand-in's, to train it where TE runs
    return mock.patch(f"{__name__}.te", modules)  # this module's global; restored at the exit


def taking_stats(n):  # REFERENCE_STATS the reference's casts take inside: 0, 2 or all (TE's
    return mock.patch(f"{__name__}.STATS_TAKEN", n)  # debug tools log theirs only when on)


standin = types.SimpleNamespace(TransformerLayer=TwinTransformerLayer, LayerNorm=nn.LayerNorm)
standin.Linear, standin.autocast = TwinLinear, reference_autocast
standin.LayerNormLinear, standin.LayerNormMLP = TwinLinear, TwinLayerNormMLP  # for FP8_GEMMS
manager = types.SimpleNamespace(get_fp8_recipe=lambda: getattr(ACTIVE_FP8.get(), "recipe", None))
standin.quantization = types.SimpleNamespace(FP8GlobalStateManager=manager)  # 6.1's recipe getter
if TE_ERROR:  # no TE here: the stand-in takes its place, so every cell below runs unchanged
    te, DelayedScaling, Format = standin, ReferenceRecipe, ReferenceFormat


import torch
import torch.nn.functional as F  # and te: import transformer_engine.pytorch as te


def train_step(model, tokens, optimizer, recipe=None, dtype=None):
    """One optimizer step: FP8 GEMMs if `recipe` is given, the rest autocast to `dtype` if given."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T) each: predict the next token
    with torch.autocast(inputs.device.type, dtype=dtype, enabled=dtype is not None):
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            logits = model(inputs)  # (B, T, vocab)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


# The modules that run FP8 GEMMs. Not te.DotProductAttention: after an FP8 forward TE gives it an
FP8_GEMMS = (te.Linear, te.LayerNormLinear, te.LayerNormMLP)  # fp8_meta too, never cast (amax 0)


def fp8_tensors(model):
    """(label, state, slot, direction) for every tensor a DelayedScaling model casts to FP8."""
    for name, module in model.named_modules():
        meta = getattr(module, "fp8_meta", {})  # TE's internal FP8 state (not a public API)
        if isinstance(module, FP8_GEMMS) and hasattr(meta.get("scaling_fwd"), "amax_history"):
            for k, gemm in enumerate(("fc1", "fc2") if meta["num_gemms"] == 2 else ("gemm",)):
                yield f"{name}.{gemm}/input", meta["scaling_fwd"], 3 * k, "forward"
                yield f"{name}.{gemm}/weight", meta["scaling_fwd"], 3 * k + 1, "forward"
                yield f"{name}.{gemm}/grad_output", meta["scaling_bwd"], 2 * k, "backward"


def print_fp8_state(model):
    """Print every FP8 tensor's newest amax, its history's largest and its scale; return them."""
    print(f"{'FP8 tensor':52} {'amax[-1]':>9} {'window max':>10} {'scale':>10} {'1/scale':>9}")
    rows = []
    for label, state, slot, _ in fp8_tensors(model):
        history, scale = state.amax_history[:, slot].tolist(), state.scale[slot].item()
        print(f"{label:52} {history[-1]:9.3g} {max(history):10.3g} {scale:10.3e} {1 / scale:9.2e}")
        rows += [{"tensor": label, "amax": history[-1], "window_max": max(history), "scale": scale}]
    return rows


# @title TE's list of FP8 models, and what the loop records after each step, by role (machinery)
import functools

ROLES = ("input", "weight", "grad_output")
FP8_GEMMS += (TwinModule,)  # and the stand-in's twins, where TE runs beside them


def fp8_snapshot(model):  # newest amax, scale and (reference) statistics per FP8 tensor, on device
    columns = []
    for _, s, i, _ in fp8_tensors(model):
        stats = s.stats[:, i] if hasattr(s, "stats") else ()
        columns.append(torch.stack((s.amax_history[-1, i], s.scale[i], *stats)))
    return torch.stack(columns, dim=-1) if columns else None  # (fields, tensors)


def start_fp8_bookkeeping(model):  # TE's list of delayed-scaling modules emptied: `model` alone
    if te is not standin:  # the list's modules' scales update when an FP8 te.autocast exits
        (manager := te.quantization.FP8GlobalStateManager).reset()
        for module in model.modules():  # and clear `model`'s TE-internal key to it
            getattr(module, "fp8_meta", {}).pop(manager.get_buffer_info(), None)


def print_scale_spread(rows):
    scales = {role: [r["scale"] for r in rows if r["tensor"].endswith(role)] for role in ROLES}
    spans = ", ".join(f"{role}s {min(s):.1e} to {max(s):.1e}" for role, s in scales.items())
    spread = max(max(s) for s in scales.values()) / min(min(s) for s in scales.values())
    print(f"\nScales: {spans}. The largest is {spread:.1e} times the smallest.")


def by_role(snapshots, model):  # as {role: {field: (steps, tensors of that role)}}, on the CPU
    steps, labels = torch.stack(snapshots).cpu(), [label for label, *_ in fp8_tensors(model)]
    fields = ("amax", "scale", *REFERENCE_STATS)[: steps.shape[1]]
    cols = {r: [i for i, label in enumerate(labels) if label.endswith("/" + r)] for r in ROLES}
    return {r: dict(zip(fields, steps[..., c].unbind(1), strict=True)) for r, c in cols.items()}


# DelayedScaling, Format: from transformer_engine.common.recipe import DelayedScaling, Format


def delayed_scaling(cfg, reduce_amax=True):
    """This notebook's recipe: TE's DelayedScaling with the parameters of section 1."""
    return DelayedScaling(
        fp8_format=Format[cfg.fp8_format],  # HYBRID: E4M3 forward, E5M2 for gradients
        amax_history_len=cfg.amax_history_len,  # how many steps of amaxes the scale looks back on
        amax_compute_algo=cfg.amax_compute_algo,  # the "max" of that window, or "most_recent"
        margin=cfg.fp8_margin,  # scale = fp8_max / 2**margin / amax
        reduce_amax=reduce_amax,  # with several GPUs: one amax for all (section 10.9)
    )


def same_on_every_rank(model):  # [FP8 state, weights]: bitwise the same on every rank?
    states = {id(s): s for _, s, _, _ in fp8_tensors(model)}.values()  # none but DelayedScaling's
    fp8, answers = [t.flatten() for s in states for t in (s.scale, s.amax_history)], []
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    for mine in (torch.cat([weights[:0], *fp8]), weights):  # without FP8 state: an empty tensor
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        answers.append(all(torch.equal(mine, theirs) for theirs in everyone))
    return answers


# @title The stand-in's FP8 state in a state dict, as TE's `_extra_state` (stand-in)
def twin_extra_state(module):  # the stand-in's get_extra_state: TE's format and rule:
    if not (meta := module.fp8_meta).get("fp8_checkpoint") or "recipe" not in meta:  # empty
        return torch.empty(0, dtype=torch.uint8)  # unless the last forward ran in FP8 (or a load)
    extra = {"num_gemms": module.num_gemms, "fp8_checkpoint": True}  # as TE's, after FP8 steps
    state = {"recipe": meta["recipe"], "extra_fp8_variables": extra}
    for d, s in (("fwd", meta["scaling_fwd"]), ("bwd", meta["scaling_bwd"])):  # on the CPU
        state |= {f"scale_{d}": s.scale.cpu(), f"amax_history_{d}": s.amax_history.cpu()}
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def load_twin_extra_state(module, state):  # set_extra_state, behind TE's gate (10.7)
    if state is None or state.numel() == 0:
        return
    if os.environ.get(gate := "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE") != "1":  # as TE 2.20.2
        raise RuntimeError(f"Unpickling runs code: set {gate}=1 to load a trusted file's FP8 state")
    state, device = pickle.loads(state.cpu().numpy().tobytes()), next(module.parameters()).device
    for d in ("fwd", "bwd"):
        history = state[f"amax_history_{d}"]
        s = module.fp8_meta[f"scaling_{d}"] = fp8_state(history.shape[1], len(history), device)
        s.scale, s.amax_history = state[f"scale_{d}"].to(device), history.to(device)
    module.fp8_meta.update(state["extra_fp8_variables"], recipe=state["recipe"])  # as TE's


TwinModule.get_extra_state, TwinModule.set_extra_state = twin_extra_state, load_twin_extra_state


cfg = Config(precision='auto', seed=1234, vocab_size=100, max_stride=6, seq_len=32, d_model=128, n_layers=2, n_heads=4, ffn_hidden=512, batch_size=32, train_steps=120, learning_rate=0.003, fp8_format='HYBRID', amax_history_len=16, amax_compute_algo='max', fp8_margin=0, eval_prompts=128, prompt_len=8, gen_tokens=16, results_json=None, te_wheel_dir=None)
