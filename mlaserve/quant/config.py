"""The checkpoint's `quantization_config` -> one frozen `QuantScheme`, each field with its source.

Formats read (weights are float8_e4m3fn, dequantized as w = q * s, s per block of the weight):
  DeepSeek FP8      quant_method "fp8", fmt "e4m3", weight_block_size [bn, bk],
                    activation_scheme "dynamic"; scale tensor `<module>.weight_scale_inv`
                    [ceil(N/bn), ceil(K/bk)] fp32 (the *inverse* of the quantizer's scale, so it
                    multiplies); optional modules_to_not_convert. expert_dtype "fp4" (DeepSeek-V4
                    style): routed experts as packed e2m1 (fp4_group.py) with per-row group-32 scales
                    under the same name. scale_fmt "ue8m0" (DeepSeek-V3.1 on): powers of two, stored
                    as fp32 or float8_e8m0fnu; both are read exactly into fp32.
  compressed-tensors quant_method "compressed-tensors", format "float-quantized", a config group
                    with weights {type float, num_bits 8, strategy block|channel|tensor,
                    block_structure [bn, bk]} and an `ignore` list (names, or "re:" regexes matched
                    from the start of the module name); scale tensor `<module>.weight_scale`:
                    block [ceil(N/bn), ceil(K/bk)], channel [N, 1], tensor [1]. A 4-bit float group
                    (NVFP4: tensor_group/16, MXFP4: group/32) is read for routed experts:
                    `weight_packed` uint8 [N, K/2], `weight_scale` (e4m3 / e8m0 bytes) [N, K/g] and
                    for NVFP4 `weight_global_scale` [1]: W = value * weight_scale / global.
                    An int group (format "pack-quantized", W4A16: type int, num_bits 4, strategy
                    group, group_size 32, symmetric; Kimi-K2.x) is read for routed experts:
                    `weight_packed` int32 [N, K/8], `weight_scale` [N, K/32], `weight_shape` [2]
                    (int4_group.py): W = q * weight_scale.
Activations stay in the compute dtype (--dtype): the dynamic activation quantization of the
release is not reproduced, so the result equals "dequantize the weight, then matmul".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mlaserve.config.model import ConfigError
from mlaserve.config.provenance import ProvenanceLog, Setting

FP8_FORMATS = ("e4m3",)


@dataclass(frozen=True)
class QuantScheme:
    method: str  # "fp8" (DeepSeek block format) | "compressed-tensors"
    fmt: str  # "e4m3"
    strategy: str  # "block" | "channel" | "tensor" ("none": a compressed-tensors config without an 8-bit group)
    block: tuple[int, int] | None  # (bn, bk) for "block"
    scale_name: str  # "weight_scale_inv" | "weight_scale"
    ignore: tuple[str, ...]  # module names / "re:" patterns kept unquantized
    settings: tuple[Setting, ...] = ()
    # routed experts: "fp8" like the rest; packed e2m1 with per-row group scales: "fp4" (DeepSeek-V4
    # style, fp32 / ue8m0 group-32 scales), "nvfp4" / "mxfp4" (compressed-tensors, see fp4_group.py)
    expert_dtype: str = "fp8"
    scale_fmt: str = "float"  # "ue8m0": every scale a power of two (stored fp32 or float8_e8m0fnu)
    group_size: int = 0  # expert_dtype "int4": columns per scale

    def block_of(self, out_features: int, in_features: int) -> tuple[int, int]:
        """The (bn, bk) block of one weight: a channel is (1, K), a whole tensor (N, K)."""
        if self.strategy == "block":
            return self.block
        return (1, in_features) if self.strategy == "channel" else (out_features, in_features)

    def scale_shape(self, out_features: int, in_features: int) -> tuple[int, ...]:
        """The stored shape of one weight's scale tensor (the format's convention)."""
        if self.strategy == "tensor":
            return (1,)
        bn, bk = self.block_of(out_features, in_features)
        return (-(-out_features // bn), -(-in_features // bk))

    def ignores(self, module: str) -> bool:
        return any(ignore_match(p, module) for p in self.ignore)


def ignore_match(pattern: str, module: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern == module


def parse_quantization(hf_config: dict, source: str = "config.json") -> QuantScheme | None:
    """None for an unquantized checkpoint; ConfigError naming the field for anything unsupported."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ConfigError(f"{source}: quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    log = ProvenanceLog()
    log.record("quant.method", method, f"{source}:quantization_config.quant_method")
    if method == "fp8":
        return _parse_deepseek_fp8(qc, source, log)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc, source, log)
    raise ConfigError(
        f"{source}: quantization_config.quant_method {method!r} is not supported "
        "(supported: 'fp8' block-scaled e4m3, 'compressed-tensors' float8)"
    )


def _parse_deepseek_fp8(qc: dict, source: str, log: ProvenanceLog) -> QuantScheme:
    key = f"{source}:quantization_config"
    fmt = qc.get("fmt", "e4m3")
    if fmt not in FP8_FORMATS:
        raise ConfigError(f"{key}.fmt {fmt!r} is not supported (supported: {list(FP8_FORMATS)})")
    log.record("quant.fmt", fmt, f"{key}.fmt" if "fmt" in qc else "format default (e4m3)")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"{key}.weight_block_size must be [rows, cols] of positive integers, got {block!r}")
    log.record("quant.strategy", "block", f"{key}.weight_block_size")
    log.record("quant.block", tuple(block), f"{key}.weight_block_size")
    act = qc.get("activation_scheme", "dynamic")
    log.record("quant.activations", f"{act} in the release; here: compute dtype", f"{key}.activation_scheme")
    log.record("quant.scale_tensor", "weight_scale_inv", "DeepSeek FP8 format")
    ignore = tuple(qc.get("modules_to_not_convert") or ())
    log.record("quant.ignore", ignore, f"{key}.modules_to_not_convert" if ignore else "none listed")
    experts, scale_fmt = _expert_dtype(qc, key, log)
    return QuantScheme("fp8", fmt, "block", tuple(block), "weight_scale_inv", ignore, log.freeze(), experts, scale_fmt)


def _expert_dtype(qc: dict, key: str, log: ProvenanceLog) -> tuple[str, str]:
    scale_fmt = qc.get("scale_fmt", "float")
    if scale_fmt not in ("float", "ue8m0"):
        raise ConfigError(f"{key}.scale_fmt {scale_fmt!r} is not supported (supported: 'float', 'ue8m0')")
    log.record("quant.scale_fmt", scale_fmt, f"{key}.scale_fmt" if "scale_fmt" in qc else "format default (float)")
    experts = qc.get("expert_dtype", "fp8")
    if experts not in ("fp8", "fp4"):
        raise ConfigError(f"{key}.expert_dtype {experts!r} is not supported (supported: 'fp8', 'fp4')")
    src = f"{key}.expert_dtype" if "expert_dtype" in qc else "format default (fp8)"
    return log.record("quant.expert_dtype", experts, src), scale_fmt


def _parse_compressed_tensors(qc: dict, source: str, log: ProvenanceLog) -> QuantScheme:
    """One 8-bit float group (block | channel | tensor) and/or one 4-bit float group (NVFP4 or
    MXFP4, read for routed experts only)."""
    key = f"{source}:quantization_config"
    int4 = _ct_int4(qc, key, log)
    if int4 is not None:
        return int4
    fp8, fp4 = _ct_groups(qc.get("config_groups") or {}, key)
    strategy, block = _ct_fp8(*fp8, log) if fp8 else ("none", None)
    experts = _ct_fp4(*fp4, log) if fp4 else "fp8"
    log.record("quant.expert_dtype", experts, f"{fp4[0]}.type/num_bits/strategy" if fp4 else "no 4-bit group")
    log.record("quant.activations", "compute dtype", "weights-only here (input_activations not reproduced)")
    log.record("quant.scale_tensor", "weight_scale", "compressed-tensors format")
    ignore = tuple(qc.get("ignore") or ())
    log.record("quant.ignore", ignore, f"{key}.ignore")
    return QuantScheme("compressed-tensors", "e4m3", strategy, block, "weight_scale", ignore, log.freeze(), experts)


INT4_GROUP = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": 32, "symmetric": True}


def _ct_int4(qc: dict, key: str, log: ProvenanceLog) -> QuantScheme | None:
    """A W4A16 pack-quantized config (one int group): INT4 routed experts, the rest stored float. None when
    the config has no int group; an int group other than INT4_GROUP is refused naming the field."""
    groups = qc.get("config_groups") or {}
    ints = [(n, g) for n, g in groups.items() if isinstance(g, dict) and (g.get("weights") or {}).get("type") == "int"]
    if not ints:
        return None
    if len(groups) != 1:
        raise ConfigError(f"{key}.config_groups: an int group beside other groups is not supported (one int4 group)")
    name, group = ints[0]
    w, gkey = group["weights"], f"{key}.config_groups.{name}.weights"
    for field, want in INT4_GROUP.items():
        if w.get(field) != want:
            raise ConfigError(
                f"{gkey}.{field} {w.get(field)!r} is not supported: int weights are read as {INT4_GROUP} (W4A16)"
            )
    fmt = qc.get("format", group.get("format"))
    if fmt != "pack-quantized":
        raise ConfigError(f"{key}.format {fmt!r} is not supported for int weights (pack-quantized)")
    log.record("quant.fmt", "int4", f"{gkey}.type/num_bits")
    log.record("quant.strategy", "group", f"{gkey}.strategy")
    log.record("quant.block", (1, 32), f"{gkey}.group_size")
    log.record("quant.expert_dtype", "int4", f"{gkey} (pack-quantized: routed experts only)")
    log.record("quant.activations", "compute dtype", "W4A16: weights only")
    log.record("quant.scale_tensor", "weight_scale", "compressed-tensors format")
    ignore = tuple(qc.get("ignore") or ())
    log.record("quant.ignore", ignore, f"{key}.ignore")
    return QuantScheme(
        "compressed-tensors", "int4", "none", None, "weight_scale", ignore, log.freeze(), "int4", group_size=32
    )


def _ct_groups(groups: dict, key: str) -> tuple[tuple[str, dict] | None, tuple[str, dict] | None]:
    found: dict[int, tuple[str, dict]] = {}
    for name, group in groups.items():
        w, gkey = group.get("weights") or {}, f"{key}.config_groups.{name}.weights"
        bits = w.get("num_bits")
        if w.get("type") != "float" or bits not in (8, 4):
            raise ConfigError(
                f"{gkey}: only float weights of 8 bits (e4m3) or 4 bits (e2m1) are supported, got "
                f"type={w.get('type')!r} num_bits={bits!r}"
            )
        if bits in found:
            raise ConfigError(f"{gkey}: a second {bits}-bit group (only one of each width is supported)")
        found[bits] = (gkey, w)
    if not found:
        raise ConfigError(f"{key}.config_groups: no weight quantization group")
    return found.get(8), found.get(4)


def _ct_fp8(gkey: str, w: dict, log: ProvenanceLog) -> tuple[str, tuple[int, int] | None]:
    strategy = w.get("strategy")
    if strategy not in ("block", "channel", "tensor"):
        raise ConfigError(f"{gkey}.strategy {strategy!r} is not supported (block, channel, tensor)")
    block = None
    if strategy == "block":
        block = w.get("block_structure")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise ConfigError(f"{gkey}.block_structure must be [rows, cols] of positive integers, got {block!r}")
        block = tuple(block)
    log.record("quant.fmt", "e4m3", f"{gkey}.type/num_bits")
    log.record("quant.strategy", strategy, f"{gkey}.strategy")
    log.record("quant.block", block, f"{gkey}.block_structure" if block else f"{strategy} strategy")
    return strategy, block


def _ct_fp4(gkey: str, w: dict, log: ProvenanceLog) -> str:
    """NVFP4: strategy tensor_group, group_size 16 (fp8 e4m3 group scales over a global scale);
    MXFP4: strategy group, group_size 32 (e8m0 scales as uint8)."""
    kind = (w.get("strategy"), w.get("group_size"))
    variants = {("tensor_group", 16): "nvfp4", ("group", 32): "mxfp4"}
    if kind not in variants:
        raise ConfigError(
            f"{gkey}: 4-bit strategy/group_size {kind} is not supported (tensor_group/16: NVFP4, group/32: MXFP4)"
        )
    return variants[kind]
