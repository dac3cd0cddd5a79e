"""Load a DeepSeek-V3.2 checkpoint from a local Hugging Face directory (``config.json`` + ``*.safetensors``).

* Sharded (``model.safetensors.index.json``) or single-file checkpoints; files are read with a
  small built-in safetensors reader (memory-mapped; no extra dependency).
* Names: the original checkpoints' per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight``
  (stacked here into the fused ``gate_up_proj`` / ``down_proj``) or transformers 5's fused names.
* Layers at or past ``num_hidden_layers`` (the multi-token-prediction layer of the released
  checkpoints) are skipped.
* fp8 block-quantised weights (``weight`` in float8_e4m3fn with ``weight_scale_inv``
  ``[ceil(out/128), ceil(in/128)]``, as in the released DeepSeek-V3.2 checkpoints) are
  dequantised to bf16 on load (``w · scale_inv`` per 128x128 block): the model then runs bf16
  weights (no fp8 GEMMs).
* Everything ends in bf16 except the router's ``e_score_correction_bias`` (fp32, as
  transformers keeps it).
"""
from __future__ import annotations

import json
import mmap
import os
import re
import struct

import torch

from .config import ModelConfig

_DTYPES = {
    "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


# --------------------------------------------------------------------------- safetensors I/O
class SafetensorsFile:
    """Minimal reader of the safetensors format: 8-byte little-endian header length, a JSON header
    ``{name: {dtype, shape, data_offsets: [begin, end]}}``, then the raw little-endian data."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        self.metadata = header.pop("__metadata__", None) or {}
        self.header = header
        self._data_start = 8 + n
        self._mm = None

    def keys(self):
        return list(self.header)

    def dtype(self, name: str) -> torch.dtype:
        return _DTYPES[self.header[name]["dtype"]]

    def get(self, name: str) -> torch.Tensor:
        """A fresh (owned, contiguous) tensor."""
        info = self.header[name]
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        b, e = info["data_offsets"]
        dt = _DTYPES[info["dtype"]]
        if e == b:
            return torch.empty(info["shape"], dtype=dt)
        if self._mm is None:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        raw = torch.frombuffer(self._mm, dtype=torch.uint8, count=e - b, offset=self._data_start + b).clone()
        return raw.view(dt).reshape(info["shape"])

    def close(self):
        if self._mm is not None:
            self._mm.close()
            self._mm = None


def save_safetensors(tensors: dict, path: str, metadata: dict | None = None) -> None:
    """Write ``{name: tensor}`` in the safetensors format (data 8-byte aligned)."""
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        if t.dtype not in _NAMES:
            raise ValueError(f"{name}: dtype {t.dtype} cannot be stored")
        data = t.view(torch.uint8).reshape(-1).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for d in blobs:
            f.write(d)


def checkpoint_files(path: str) -> list:
    idx = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, x) for x in files]
    files = sorted(x for x in os.listdir(path) if x.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"model: no *.safetensors in {path}")
    return [os.path.join(path, x) for x in files]


# --------------------------------------------------------------------------- names
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def hf_state_dict(model) -> dict:
    """The model's weights under the original checkpoints' names (per-expert matrices)."""
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        m = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
        if m is None:
            out[name] = t
            continue
        base = m.group(1)
        for e in range(t.shape[0]):
            if m.group(2) == "down_proj":
                out[f"{base}.{e}.down_proj.weight"] = t[e]
            else:
                g, u = t[e].chunk(2, dim=0)
                out[f"{base}.{e}.gate_proj.weight"] = g
                out[f"{base}.{e}.up_proj.weight"] = u
    return out


def dequant_fp8_block(w: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    """``w`` fp8 ``[out, in]`` times its per-block ``scale_inv [ceil(out/b0), ceil(in/b1)]`` -> bf16."""
    o, i = w.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:o].repeat_interleave(block[1], 1)[:, :i]
    return (w.float() * s).to(torch.bfloat16)


# --------------------------------------------------------------------------- loading
def cast_model_(model, dtype=torch.bfloat16):
    """bf16 everywhere except the router's fp32 ``e_score_correction_bias`` (as transformers)."""
    model.to(dtype)
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.e_score_correction_bias.data = layer.mlp.gate.e_score_correction_bias.data.float()
    return model


def load_model(path: str, device="cpu", *, indexer_dtype: str = "fp8", hadamard: bool | None = None,
               kv_format: str = "bf16", backend: str | None = None):
    """Build :class:`~dsa.model.model.DeepseekV32ForCausalLM` from ``path`` and load its weights."""
    from .layers import RotaryEmbedding
    from .model import DeepseekV32ForCausalLM

    cfg = ModelConfig.from_json(path)
    device = torch.device(device)
    with torch.device("meta"):
        model = DeepseekV32ForCausalLM(cfg)
    model.to_empty(device=device)
    cast_model_(model)
    model.model.rotary_emb = RotaryEmbedding(cfg).to(device)  # non-persistent buffer: rebuild
    model.set_options(indexer_dtype=indexer_dtype, hadamard=hadamard, kv_format=kv_format, backend=backend)

    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    params.pop("model.rotary_emb.inv_freq", None)
    filled = set()
    expert_filled = set()
    block = tuple((cfg.quantization_config or {}).get("weight_block_size") or (128, 128))

    files = [SafetensorsFile(f) for f in checkpoint_files(path)]
    where = {k: f for f in files for k in f.keys()}
    unexpected = []
    try:
        for name, f in where.items():
            if name.endswith("_scale_inv") or name.endswith("rotary_emb.inv_freq"):
                continue
            m = _LAYER.match(name)
            if m and int(m.group(1)) >= cfg.num_hidden_layers:
                continue  # MTP layer(s)
            t = f.get(name)
            if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                sname = name + "_scale_inv"  # "...weight" -> "...weight_scale_inv"
                if sname not in where:
                    raise ValueError(f"{name}: fp8 weight without its {sname}")
                t = dequant_fp8_block(t, where[sname].get(sname), block)
            em = _EXPERT.match(name)
            if em:
                li, e, part = int(em.group(1)), int(em.group(2)), em.group(3)
                base = f"model.layers.{li}.mlp.experts."
                if base + "down_proj" not in params or e >= cfg.n_routed_experts:
                    unexpected.append(name)
                    continue
                I = cfg.moe_intermediate_size
                if part == "down_proj":
                    dst = params[base + "down_proj"].data[e]
                elif part == "gate_proj":
                    dst = params[base + "gate_up_proj"].data[e, :I]
                else:
                    dst = params[base + "gate_up_proj"].data[e, I:]
                _copy(name, dst, t)
                expert_filled.add((li, e, part))
                continue
            if name not in params:
                unexpected.append(name)
                continue
            _copy(name, params[name].data, t)
            filled.add(name)
    finally:
        for f in files:
            f.close()
    if unexpected:
        raise ValueError(f"model: {len(unexpected)} unexpected tensors in {path}, e.g. {unexpected[:5]}")
    if cfg.tie_word_embeddings and "lm_head.weight" not in filled:
        params["lm_head.weight"].data.copy_(params["model.embed_tokens.weight"].data)
        filled.add("lm_head.weight")
    for li, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "experts"):
            base = f"model.layers.{li}.mlp.experts."
            if base + "gate_up_proj" in filled:
                continue
            miss = [(li, e, p) for e in range(cfg.n_routed_experts) for p in ("gate_proj", "up_proj", "down_proj")
                    if (li, e, p) not in expert_filled]
            if miss:
                raise ValueError(f"model: {len(miss)} expert weights missing in {path}, e.g. layer {li} expert "
                                 f"{miss[0][1]} {miss[0][2]}")
            filled.update({base + "gate_up_proj", base + "down_proj"})
    missing = [n for n in params if n not in filled]
    if missing:
        raise ValueError(f"model: {len(missing)} weights missing in {path}, e.g. {missing[:5]}")
    return model.eval()


def _copy(name, dst: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{name}: expected shape {list(dst.shape)}, got {list(src.shape)}")
    dst.copy_(src.to(dst.dtype))
