"""From a path (a Hugging Face folder or a GGUF file) to a filled model, its engine config and tokenizer: open
(config read and resolved, what the engine does not run refused, no weight read) -> Checkpoint, then fill ->
LoadedModel (loading/loaded.py). resolve()'s questions of the checkpoint are loading/probes.py's, its tokenizer
loading/checkpoint_tokenizer.py's."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from mlaserve.config import families
from mlaserve.config.deepseek_v4 import DeepseekV4Config, is_v4
from mlaserve.config.engine import EngineOptions, resolve
from mlaserve.config.machine import BF16_BITS, INT8_BITS, PREFILL_TILES
from mlaserve.config.model import ConfigError, ModelConfig
from mlaserve.config.provenance import Setting
from mlaserve.distributed.expert_parallel import cut_experts, expert_range, shard_experts
from mlaserve.distributed.sharding import (
    at_load_split_notes,
    check_splits,
    span_notes,
)
from mlaserve.kernels.ggml import dense_native
from mlaserve.kernels.registry import KernelContext, KernelPlan, plan_kernels
from mlaserve.loading.allocate import allocate
from mlaserve.loading.checkpoint_tokenizer import folder_tokenizer, gguf_tokenizer, set_encoding
from mlaserve.loading.files import path_problem, read_json, regular_file
from mlaserve.loading.loaded import Checkpoint, LoadedModel
from mlaserve.loading.prefetch import start_prefetch
from mlaserve.loading.probes import has_gguf_blocks, has_indexer_weights, indexer_bits, native_probe, stored_bf16
from mlaserve.loading.rank_view import RankView, rank_view
from mlaserve.loading.safetensors_source import SafetensorsSource, WeightError
from mlaserve.loading.tensor_check import format_bad, scan_gguf, scan_model
from mlaserve.loading.text_part import TextPartSource, decide_tie
from mlaserve.loading.weights import LoadReport, load_weights
from mlaserve.models.deepseek import MLAForCausalLM
from mlaserve.models.glm5_next import Glm5NextForCausalLM
from mlaserve.models.longcat import LongcatForCausalLM
from mlaserve.models.mtp import MTPLayer, MTPLayout, mtp_layouts
from mlaserve.platform.triton_runtime import triton_mode
from mlaserve.quant.at_load import BLOCK as BLOCK_AT_LOAD
from mlaserve.quant.at_load import quantize_model
from mlaserve.quant.config import parse_quantization
from mlaserve.quant.ggml_layer import decode_layer_misses, enable_decode_step
from mlaserve.quant.ggml_linear import BLOCK_TOKENS
from mlaserve.quant.ggml_moe_block import attach_moe_blocks  # noqa: F401 -- registers the plan's "moe_block" op
from mlaserve.quant.ggml_plan import BlockSource, GGUFPlan, attach_heads, plan_gguf, swap_in_gguf
from mlaserve.quant.plan import densify, plan_quantization, swap_in
from mlaserve.tools.select import chat_formats


def read_hf_config(folder: Path) -> dict:
    path = folder / "config.json"
    if path_problem(path) == "does not exist":
        raise ConfigError(f"{folder}: no config.json")
    return read_json(path, ConfigError)


def build_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    experts_impl: str = "grouped_mm",
    device: str = "cpu",
    mtp: tuple[MTPLayout, ...] = (),
    prepare=None,
    **rank,
) -> MLAForCausalLM:
    """Allocate without initialising (the weights come next), in dtype; the router stays fp32
    like the reference keeps its gate weight and correction bias. rank: vocab_start and
    all_reduce of a tensor-parallel rank (MLAForCausalLM). `mtp`: MTP layers to build (speculative
    decoding), as `model.mtp`. `prepare(model)`: runs on the meta-device model before anything is
    allocated (GGUF holders swapped in there never allocate the float weights they replace)."""
    # the family's decoder layer: LongCat-Flash's two sublayers, GLM-5.3-Flash's mHC streams, else one MLA layer
    model_cls = LongcatForCausalLM if cfg.sublayers > 1 else Glm5NextForCausalLM if cfg.hyper else MLAForCausalLM
    with torch.device("meta"):
        model = model_cls(cfg, **rank)
        if mtp:
            model.mtp = nn.ModuleList(MTPLayer(cfg, layout, **rank) for layout in mtp)
        if prepare is not None:
            prepare(model)
    allocate(model, device)
    model.to(dtype)
    for name, module in model.named_modules():
        if name.endswith(("mlp.gate", "mlp.router")):  # mlp.router: LongCat-Flash's (classifier + bias)
            module.float()
        if hasattr(module, "keep_fp32"):  # parameters the reference keeps fp32 in any dtype (KDA's dt_bias)
            module.keep_fp32()
        if name.endswith("mlp.experts"):
            module.impl = experts_impl
    return model.eval()


def load_model(path: str | Path, opts: EngineOptions, progress=None, comm=None) -> LoadedModel:
    """comm: this rank's Collectives when opts.tensor_parallel_size > 1 (it loads only its slices)."""
    loaded = fill_model(open_checkpoint(path, opts), progress, comm)
    # the mapped files read into the page cache, once per machine (rank 0: the ranks map the same files)
    if loaded.config.kernels.gguf_prefetch and (comm is None or comm.rank == 0):
        from mlaserve.gguf.read.file import split_paths

        loaded.prefetch, note = start_prefetch(split_paths(loaded.path))
        loaded.report.notes.append(note)
    return loaded


def open_checkpoint(path: str | Path, opts: EngineOptions) -> Checkpoint:
    path = Path(path)
    problem = path_problem(path)
    if problem == "does not exist":
        raise FileNotFoundError(f"model path {path} does not exist")
    if problem is not None:
        raise ConfigError(f"model path {path} {problem}")
    skipped_note = ""
    if not path.is_dir() and regular_file(path, ConfigError):
        if path.suffix != ".gguf":
            raise ConfigError(f"{path}: expected a Hugging Face folder (config.json + *.safetensors) or a .gguf file")
        from mlaserve.gguf.read.file import open_gguf

        gf = open_gguf(path)  # its header parsed once: the architecture picks the reader, which takes the file
        if gf.metadata.get("general.architecture") == "deepseek4":
            gf.close()
            return _open_v4_gguf(path, opts)
        model_cfg, source, tokenizer, skipped = _open_gguf(path, gf, opts.check_tensors, opts.speculative == "mtp")
        scheme = None
    else:
        hf_config = read_hf_config(path)
        if is_v4(hf_config):
            return _open_v4(path, hf_config, opts)
        model_cfg = ModelConfig.from_hf(hf_config, source="config.json")
        scheme = parse_quantization(hf_config)
        source, skipped = SafetensorsSource(path), []
        wrapper = families.by_model_type(hf_config.get("model_type"))
        if wrapper is not None and wrapper.text_config:  # the text model of a multimodal checkpoint
            source = TextPartSource(source, wrapper)
            model_cfg = decide_tie(model_cfg, source)
            skipped, skipped_note = list(source.skipped.names), source.skipped.note(wrapper.name)
            text = hf_config.get("text_config") or {}
            if scheme is None and "quantization_config" in text:  # where Kimi-K2.x releases keep it
                scheme = parse_quantization(text, source="config.json:text_config")
        tokenizer = folder_tokenizer(path, model_cfg)
    _refuse_unsupported(path, model_cfg, opts)
    quantized = scheme is not None or has_gguf_blocks(source) or opts.quantization is not None
    probe = native_probe if quantized else None
    engine_cfg = resolve(
        model_cfg,
        opts,
        has_indexer_weights(source.names()),
        native_kernels=probe,
        gguf=path.is_file(),
        stored_bf16=lambda: stored_bf16(source),
        triton=triton_mode,
        indexer_bits=lambda: indexer_bits(source),
    )
    template = tokenizer.chat_template if tokenizer is not None else None
    encoding = set_encoding(tokenizer, model_cfg.model_type)
    engine_cfg = chat_formats(engine_cfg, template, opts.tool_call_parser, opts.reasoning_parser, encoding=encoding)
    if engine_cfg.kernels.quantization is not None and (scheme is not None or has_gguf_blocks(source)):
        stored = f"{scheme.method} {scheme.fmt}" if scheme is not None else "GGUF block-quantized"
        raise ConfigError(
            f"{path}: quantization={engine_cfg.kernels.quantization!r} is for float checkpoints; this one is already "
            f"{stored} (its stored blocks are used as they are)"
        )
    if model_cfg.swiglu_limit is not None and scheme is not None:  # GLM-5.3-Flash's clamps live in the float modules
        raise ConfigError(
            f"{path}: {model_cfg.model_type} stored {scheme.method} {scheme.fmt}: not supported (the quantized expert "
            "and linear holders run the plain SwiGLU, not its swiglu_limit clamps)"
        )
    if model_cfg.kda is not None:  # Kimi-Linear, GLM-5.3-Flash: what KDA layers do not run yet, refused with the reason
        for name, given, why in (
            ("tensor_parallel_size", engine_cfg.parallel.tensor_parallel_size > 1, "its KDA layers are not split"),
            ("quantization", engine_cfg.kernels.quantization is not None, "its KDA layers have no quantized holders"),
        ):
            if given:
                raise ConfigError(
                    f"{path}: {model_cfg.model_type} with {name}={getattr(opts, name)!r}: not supported ({why})"
                )
    if engine_cfg.parallel.expert_parallel_size > 1:
        _refuse_expert_parallel(path, model_cfg, engine_cfg)
    if engine_cfg.parallel.tensor_parallel_size > 1:
        check_splits(model_cfg, engine_cfg.parallel.tensor_parallel_size)
        if scheme is not None and not _tp_splits(scheme, engine_cfg.parallel.expert_parallel_size):
            raise ConfigError(
                f"{path}: tensor_parallel_size={engine_cfg.parallel.tensor_parallel_size} with a quantized checkpoint "
                f"({scheme.method} {scheme.fmt}, strategy {scheme.strategy}, experts {scheme.expert_dtype}) is not "
                "supported yet (FP8 block scales are split; channel / tensor scales are not, FP4 / INT4 expert groups "
                "only with expert_parallel_size > 1, which holds them whole)"
            )
    return Checkpoint(path, model_cfg, engine_cfg, source, tokenizer, skipped, scheme, opts.check_tensors, skipped_note)


def _tp_splits(scheme, ep: int) -> bool:
    """Tensor parallelism can hold this quantized checkpoint: FP8 block scales are split with their weights;
    FP4 / INT4 expert groups are not split, but under TP x EP the experts are held whole (distributed/mesh.py),
    so there only the linears' scales (FP8 blocks, or none) must split."""
    if scheme.expert_dtype == "fp8":
        return scheme.strategy == "block"
    return ep > 1 and scheme.strategy in ("block", "none")


def _refuse_unsupported(path: Path, model_cfg: ModelConfig, opts: EngineOptions) -> None:
    """The engine options the family does not run (Family.unsupported), refused before any weight is read."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineOptions)}
    for name, why in model_cfg.family.unsupported.items():
        if getattr(opts, name) != defaults[name]:
            raise ConfigError(
                f"{path}: {model_cfg.model_type} with {name}={getattr(opts, name)!r}: not supported ({why})"
            )


def _open_v4(path: Path, hf_config: dict, opts: EngineOptions) -> Checkpoint:
    """A DeepSeek-V4 folder: its own config reader, then the options this first landing does not run refused
    with their reason (README, docs/DEEPSEEK_V4.md)."""
    model_cfg = DeepseekV4Config.from_hf(hf_config, source=f"{path.name}/config.json")
    scheme = parse_quantization(hf_config)
    _refuse_v4(path, opts)
    if opts.expert_parallel_size > 1:  # more ranks than experts: a named error before any worker starts
        expert_range(model_cfg.moe.n_routed_experts, 0, opts.expert_parallel_size)
    if scheme is not None:  # refused here, before any weight is read, when V4 has no holder for its form
        from mlaserve.loading.deepseek_v4 import check_scheme

        check_scheme(scheme, path)
    # V4's indexer weights belong to its CSA layers (declared as their states), not to an MLA DSA indexer; its FP8 /
    # FP4 holders (quant/deepseek_v4.py) have the native kernels of FP8Linear / FP8Experts / FP4Experts
    probe = native_probe if scheme is not None else None
    engine_cfg = resolve(model_cfg, opts, has_indexer_weights=False, native_kernels=probe, triton=triton_mode)
    tokenizer = folder_tokenizer(path, model_cfg)
    set_encoding(tokenizer, model_cfg.model_type)
    return Checkpoint(path, model_cfg, engine_cfg, None, tokenizer, [], scheme)


def _gguf_arch(path: Path) -> str | None:
    from mlaserve.gguf.read.file import open_gguf

    gf = open_gguf(path)
    try:
        return gf.metadata.get("general.architecture")
    finally:
        gf.close()


def _open_v4_gguf(path: Path, opts: EngineOptions) -> Checkpoint:
    """A deepseek4 GGUF (llama.cpp's layout): every key, tensor name and shape checked at open
    (gguf/read/deepseek_v4.py); the weights are read by _fill_v4."""
    from mlaserve.gguf.read.deepseek_v4 import load_v4_gguf
    from mlaserve.gguf.read.file import GGUFError, open_gguf

    _refuse_v4(path, opts)
    if opts.check_tensors:
        bad = scan_gguf(open_gguf(path))
        if bad:
            raise GGUFError(f"{path}: check_tensors: {format_bad(bad)}")
    ck = load_v4_gguf(path)
    tokenizer = None
    if ck.tokenizer is not None:
        tokenizer = gguf_tokenizer(path, ck.tokenizer, ck.config.eos_token_ids)
        set_encoding(tokenizer, ck.config.model_type)
    blocks = any(ck.tensors.gguf_type(n) not in ("F32", "F16", "BF16", "I32") for n in ck.tensors.names())
    engine_cfg = resolve(
        ck.config,
        opts,
        has_indexer_weights=False,
        native_kernels=native_probe if blocks else None,
        gguf=True,
        triton=triton_mode,
    )
    ck.close()
    return Checkpoint(path, ck.config, engine_cfg, None, tokenizer, list(ck.skipped), None, opts.check_tensors)


def _refuse_expert_parallel(path: Path, model_cfg, engine_cfg) -> None:
    """What expert parallelism does not spread yet, refused with the reason."""
    n = engine_cfg.parallel.expert_parallel_size
    why = None
    if model_cfg.moe is None:
        why = "the model has no MoE layers"
    elif model_cfg.kda is not None:
        why = "its KDA layers are not built for several ranks"
    else:
        expert_range(model_cfg.moe.n_routed_experts, 0, n)  # more ranks than experts: a named error
    if why is not None:
        raise ConfigError(f"{path}: expert_parallel_size={n}: not supported ({why})")


def _refuse_v4(path: Path, opts: EngineOptions) -> None:
    """The options DeepSeek-V4 does not run yet, refused with their reason (README, docs/DEEPSEEK_V4.md)."""
    refused = {
        "tensor_parallel_size": (opts.tensor_parallel_size != 1, "its layers are not split across ranks yet"),
        # a DeepSeek FP8 / FP4-expert folder loads into its holders (quant/deepseek_v4.py); quantizing float V4
        # weights at load (int8 / int4 into GGUF blocks) is not built: those holders are MLA modules
        "quantization": (opts.quantization is not None, "quantizing its float weights at load is not built"),
        # a V4 folder's MTP layer drafts (models/deepseek_v4/mtp.py; rejected drafts rolled back by rollback.py);
        # llama.cpp's deepseek4 converter writes no MTP tensors, so a GGUF has none to draft with
        "speculative": (
            opts.speculative is not None and path.is_file(),
            "llama.cpp's deepseek4 GGUF layout carries no MTP layer; use the folder",
        ),
        # refused here, before any weight is read (config/kv_cache.py _quantize_v4 refuses it again later)
        "kv_cache_dtype": (
            opts.kv_cache_dtype not in ("auto", "fp8_e4m3"),
            "the official code rounds its rows through FP8 only: kv_cache_dtype='fp8_e4m3' keeps its compressed "
            "rows in that format (no int8 or 16-bit layout of its pools and rings)",
        ),
    }
    for name, (given, why) in refused.items():
        if given:
            raise ConfigError(f"{path}: DeepSeek-V4 with {name}={getattr(opts, name)!r}: not supported ({why})")


def _fill_v4(ck: Checkpoint, comm=None) -> LoadedModel:
    """comm: this rank's Collectives under expert parallelism (it holds and reads its range of the experts)."""
    from mlaserve.loading.deepseek_v4 import load_folder, plan_v4_kernels
    from mlaserve.models.deepseek_v4.serving import V4Serving

    cfg = ck.engine_cfg
    ep, e = cfg.parallel.expert_parallel_size, ck.model_cfg.moe.n_routed_experts
    experts = expert_range(e, comm.rank, ep) if ep > 1 else None  # the rank's routed experts, in either form
    if ck.path.is_file():  # a deepseek4 GGUF: block-quantized tensors kept in their blocks (gguf_weights)
        from mlaserve.loading.deepseek_v4 import load_gguf

        quantized = cfg.kernels.gguf_weights == "quantized"
        model, v4, opened = load_gguf(ck.path, cfg.runtime.dtype, quantized, experts=experts)
        opened.close()
    else:
        model, v4 = load_folder(ck.path, cfg.runtime.dtype, mtp=cfg.speculative.method == "mtp", experts=experts)
    report = LoadReport(loaded=v4.loaded, skipped=list(v4.skipped), bytes_read=v4.bytes_read or None)
    if v4.gguf is not None:
        report.notes.append(v4.gguf.summary())
    if v4.quant is not None:
        q = v4.quant
        report.notes.append(
            f"{q.scheme.method} {q.scheme.fmt} {q.scheme.strategy} {q.scheme.block or ''}: {len(q.linears)} "
            f"linear(s) and {len(q.experts)} expert stack(s) ({q.scheme.expert_dtype}) kept quantized, "
            f"{len(q.kept)} linear(s) stored float"
        )
    if v4.skipped:
        report.notes.append(f"skipped {len(v4.skipped)} tensor(s) of layers not built yet (MTP)")
    serving = V4Serving(model.to(cfg.runtime.device), numerics=cfg.attention.v4_numerics).eval()
    if cfg.parallel.expert_parallel_size > 1:  # every MoE layer (hash or learned) through the rank's partial sum
        serving.expert_received, notes = shard_experts(model, comm.rank, ep, comm.all_reduce)
        notes.append(
            f"rank {comm.rank}: read {v4.bytes_read} bytes of tensors from the checkpoint (the other ranks' "
            f"{v4.hidden} routed-expert tensors not read)"
        )
        serving.rank_notes, serving.file_bytes_read = tuple(notes), v4.bytes_read
        report.notes.extend(notes)
    # every holder's implementation, chosen with its reason (kernels/registry.py), after the expert-parallel cut
    kcfg = cfg.kernels
    plan, kernels_line = plan_v4_kernels(
        model,
        kcfg.impl,
        INT8_BITS[kcfg.activations],
        BF16_BITS[kcfg.prefill_matmul],
        kcfg.prefill_matmul in PREFILL_TILES,
    )
    serving.take_plan(plan)
    report.notes.append(kernels_line)
    report.notes.append(
        f"DeepSeek-V4: {serving.v4_implementation} (models/deepseek_v4: the softmax and the state update)"
    )
    if (numerics := cfg.attention.v4_numerics).official:  # config/v4_numerics.py
        report.notes.append(
            f"DeepSeek-V4 numerics as DeepSeek's own inference code: KV rows {numerics.kv_rounding}, indexer "
            f"{numerics.indexer} (transformers' default: none, exact)"
        )
    gen = {} if ck.path.is_file() else read_json(ck.path / "generation_config.json", ConfigError, required=False) or {}
    return LoadedModel(serving, cfg, ck.tokenizer, report, ck.path, gen, v4.quant, v4.gguf, (), serving.kernel_plan)


def fill_model(ck: Checkpoint, progress=None, comm=None) -> LoadedModel:
    if isinstance(ck.model_cfg, DeepseekV4Config):
        return _fill_v4(ck, comm)
    engine_cfg, skipped, path, scheme = ck.engine_cfg, ck.skipped, ck.path, ck.scheme
    n, ep = engine_cfg.parallel.tensor_parallel_size, engine_cfg.parallel.expert_parallel_size
    view = rank_view(ck, comm)
    model_cfg, source = view.model_cfg, view.source
    read_before = getattr(ck.source, "bytes_read", None)
    layouts = _mtp_layouts(path, source, model_cfg) if engine_cfg.speculative.method == "mtp" else ()
    gguf: list[GGUFPlan] = []

    def prepare(meta_model: nn.Module) -> None:  # on the meta device, before anything is allocated
        if ep > 1:  # the experts modules cut to this rank's range: the holders below are made for those only
            cut_experts(meta_model, view.ep_rank, view.ep_n, ck.model_cfg.moe if view.whole else None)
        if engine_cfg.kernels.gguf_weights == "quantized":  # holders swapped in before the strict fill
            native = engine_cfg.kernels.impl == "native"
            # the reference backend's absorbed path reads kv_b_proj dense at every step: held there
            transient = native and engine_cfg.attention.backend != "reference"
            gguf.append(plan_gguf(source, model_cfg, meta_model, kept_heads=native, transient_kv_b=transient))
            swap_in_gguf(meta_model, gguf[0], engine_cfg.runtime.dtype)

    model = build_model(
        model_cfg,
        engine_cfg.runtime.dtype,
        engine_cfg.kernels.experts_impl,
        engine_cfg.runtime.device,
        layouts,
        prepare,
        **view.rank_args,
    )
    gguf_plan = gguf[0] if gguf else None
    notes_first = None
    # the loader keeps the file's mapped bytes as the holders' weights (gguf_mmap), or copies them in
    mapped = engine_cfg.kernels.gguf_mmap and engine_cfg.runtime.device == "cpu"
    decoded_note = _decode_natively(ck.source, engine_cfg)
    if gguf_plan is not None:
        source = BlockSource(source, gguf_plan.blocks, mapped, gguf_plan.skipped())
    quant = None
    if scheme is not None and n > 1 and scheme.block is not None:  # its scales on its slices' grid (regrid_fp8)
        grid = view.sharded.regrid_fp8(scheme.scale_name, scheme.block)
        if grid != scheme.block:
            notes_first = (
                f"rank {comm.rank}: {scheme.method} {scheme.fmt} kept per rank; its slices start inside the "
                f"checkpoint's {list(scheme.block)} blocks, so its scales are held on {list(grid)} blocks "
                "(each inside one stored block, with that block's scale: the same weights)"
            )
            scheme = dataclasses.replace(scheme, block=grid)
    if scheme is not None:  # quantized modules swapped in before the strict fill, densified after
        # + the skipped parts' modules: an ignore pattern may name only them (a wrapper's "re:.*vision_tower.*")
        modules = {name for name, _ in model.named_modules()} | {n.rsplit(".", 1)[0] for n in skipped}
        quant = swap_in(model, plan_quantization(scheme, source.names(), model_cfg, modules), engine_cfg.runtime.dtype)
    report = load_weights(model, source, model_cfg, progress)
    if decoded_note:
        report.notes.append(decoded_note)
    if n > 1:  # what this rank holds in another form than its even slice: in its echo too (rank 0 prints them)
        _note_tp_rank(model, report, view, engine_cfg, f"rank {comm.rank}", notes_first)
    if isinstance(model, LongcatForCausalLM):  # its power-of-two latent scales into the filled weights (exact)
        report.notes.append(model.fold_latent_scales())
    if gguf_plan is not None:
        attach_heads(model, view.sharded, gguf_plan, model_cfg, mapped)
        report.notes.append(gguf_plan.summary())
    quantized_at_load: tuple[Setting, ...] = ()
    if engine_cfg.kernels.quantization is not None:  # float weights -> Q8_0 / Q4_0 holders, module by module
        quantized_at_load = quantize_model(model, engine_cfg.kernels.quantization, engine_cfg.runtime.dtype)
        report.notes.append(
            f"quantization={engine_cfg.kernels.quantization}: {len(quantized_at_load)} module kind(s) listed"
        )
    if read_before is not None:  # the checkpoint's tensor bytes this load read (an EP rank: its experts only)
        report.bytes_read = model.file_bytes_read = ck.source.bytes_read - read_before
    if ep > 1:  # this rank's range of every MoE layer's routed experts; the rest replicated (expert_parallel.py)
        _shard_ep_rank(model, report, view, f"rank {comm.rank}")
    blocks_held = gguf_plan is not None or bool(quantized_at_load)
    kernel_plan = _plan_kernels(model, engine_cfg, report, blocks_held)
    for layer in getattr(model, "mtp", ()):
        layer.share_trunk(model.embed, model.lm_head)  # model.embed: vocabulary-parallel under TP
    if quant is not None:
        densify(model, quant, engine_cfg.runtime.dtype)
        report.notes.append(
            f"{scheme.method} {scheme.fmt} {scheme.strategy} {scheme.block or ''}: {len(quant.linears)} linear(s) and "
            f"{len(quant.experts)} expert stack(s) quantized, {len(quant.kept)} linear(s) kept unquantized"
        )
    if ck.check_tensors and not path.is_file():  # a GGUF was scanned before loading
        bad = scan_model(model)
        if bad:
            raise WeightError(f"{path}: check_tensors: {format_bad(bad)}")
        report.notes.append("check_tensors: every weight is finite")
    if skipped:
        report.skipped.extend(skipped)
        report.notes.append(ck.skipped_note or f"skipped {len(skipped)} GGUF nextn/MTP tensor(s)")
    gen = (read_json(path / "generation_config.json", ConfigError, required=False) if path.is_dir() else None) or {}
    return LoadedModel(
        model, engine_cfg, ck.tokenizer, report, path, gen, quant, gguf_plan, quantized_at_load, kernel_plan
    )


def _note_tp_rank(
    model: nn.Module, report: LoadReport, view: RankView, engine_cfg, who: str, first: str | None
) -> None:
    """What a TP rank holds in another form than its even slice, in the report and on the model (its echo)."""
    notes = span_notes(view.sharded, who) + ([first] if first else [])
    if engine_cfg.kernels.quantization is not None:
        notes += at_load_split_notes(view.sharded, BLOCK_AT_LOAD, engine_cfg.kernels.quantization, who)
    model.rank_notes = tuple(notes)
    report.notes.extend(model.rank_notes)


def _shard_ep_rank(model: nn.Module, report: LoadReport, view: RankView, who: str) -> None:
    """This EP rank's range of every MoE layer's routed experts (distributed/expert_parallel.py), noted."""
    adds = not view.whole or view.place.tp_rank == 0  # whole experts: the world's sum added once per TP group
    model.expert_received, notes = shard_experts(model, view.ep_rank, view.ep_n, view.ep_reduce, who, adds)
    notes.append(
        f"{who}: read {report.bytes_read} bytes of tensors from the checkpoint (the other ranks' "
        f"{view.ranged.hidden} routed-expert tensors not read)"
    )
    model.rank_notes = (*getattr(model, "rank_notes", ()), *notes)
    report.notes.extend(notes)


def _plan_kernels(model: nn.Module, engine_cfg, report: LoadReport, blocks_held: bool) -> KernelPlan:
    """Every op's implementation, chosen with its reason (kernels/registry.py) and applied to the modules as it
    goes; then the one-call decode steps, and the report's notes on them (blocks_held: GGUF or at-load blocks)."""
    kcfg = engine_cfg.kernels
    ctx = KernelContext(
        kcfg.impl, INT8_BITS[kcfg.activations], BF16_BITS[kcfg.prefill_matmul], kcfg.prefill_matmul in PREFILL_TILES
    )
    kernel_plan = plan_kernels(model, ctx)
    model.kernel_plan = kernel_plan
    layers = enable_decode_step(model)
    blocks = sum(c.op == "moe_block" and c.impl == "native" and c.layer.isdigit() for c in kernel_plan.choices)
    if blocks:
        report.notes.append(f"{blocks} MoE layer(s) run steps of <= {BLOCK_TOKENS} tokens as one native call")
    if layers:
        report.notes.append(
            f"{layers} decoder layer(s) run pure decode steps of <= {BLOCK_TOKENS} requests as one native call each"
        )
    if kcfg.impl == "native" and blocks_held:  # block holders on the native kernels: say what did not fit
        report.notes.extend(decode_layer_misses(kernel_plan))
    return kernel_plan


def _mtp_layouts(path: Path, source, cfg: ModelConfig) -> tuple[MTPLayout, ...]:
    layouts = mtp_layouts(source.names(), cfg)
    if not layouts:
        raise ConfigError(
            f"{path}: speculative='mtp' needs the checkpoint's MTP layer (model.layers.{cfg.num_layers}.eh_proj "
            "and the rest of that layer); this checkpoint has none"
        )
    return layouts


def _decode_natively(source, engine_cfg) -> str | None:
    """A GGUF's tensors held dense (kv_b_proj rebuilt from attn_k_b / attn_v_b; every weight with
    gguf_weights=dequantized) decoded by the native kernels where the engine runs them (kernels=native): the
    reference's values bit for bit, without its bit unpacking in torch ops (the standard model's Q4_K_M file:
    5 of a 7 s fill at load average 20 on 2 cores). The load report's note says so."""
    from mlaserve.gguf.read.checkpoint import GGUFTensors

    if engine_cfg.kernels.impl != "native" or not isinstance(source, GGUFTensors):
        return None
    source.decode_with(dense_native)
    return "tensors held dense decoded from the GGUF's blocks by the native kernels (kernels=native), bit for bit"


def _open_gguf(path: Path, gf, check_tensors: bool = False, with_mtp: bool = False):
    """GGUF metadata -> config (each field's source is its GGUF key or the llama.cpp default taken),
    tensors under Hugging Face names, and the tokenizer built from tokenizer.ggml.*. gf: the opened file."""
    from mlaserve.gguf.read.checkpoint import load_gguf
    from mlaserve.gguf.read.file import GGUFError

    if check_tensors:  # before load_gguf's numeric checks, which a NaN scale would fail less clearly
        bad = scan_gguf(gf)
        if bad:
            raise GGUFError(f"{path}: check_tensors: {format_bad(bad)}")
    ck = load_gguf(path, with_mtp=with_mtp, file=gf)
    sources = {k: src for k, (_, src) in ck.provenance.items()}
    model_cfg = ModelConfig.from_hf(ck.hf_config, source=path.name, field_sources=sources)
    return model_cfg, ck.tensors, gguf_tokenizer(path, ck.tokenizer, model_cfg.eos_token_ids), list(ck.skipped)
