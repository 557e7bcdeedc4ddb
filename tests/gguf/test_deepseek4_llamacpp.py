"""llama.cpp runs the deepseek4 GGUF `mlaserve convert` writes: its logits == transformers' on the folder.

The independent check of the converter, the layout and the model together: llama.cpp's own loader and deepseek4
graph (llama-cpp-python's C API, every position's logits) on the file, against transformers' deepseek_v4 on the
Hugging Face folder it came from, at every position of a prompt that closes CSA windows (ratio 4) every 4 tokens
and HCA windows (ratio 128) at 128, 256 and 384: 3 x 128 + 5 tokens, in one pass, in 7-token micro-batches and
token by token (llama.cpp's compressor carry state across calls).

Skipped where llama-cpp-python is not installed (an optional dependency; CI has none).

The tiny model is shaped to what llama.cpp's deepseek4 code accepts (src/models/deepseek4.cpp and
src/llama-kv-cache*.cpp of the llama.cpp that llama-cpp-python 0.3.36 vendors): hc_mult 4 (build_hc_pre asserts
it), compress ratios 0 / 4 / 128 only (its loader throws on others), an indexer head width a multiple of 64 (its
indexer rotates queries and keys by Hadamard blocks of 64 or more), heads a multiple of o_groups, and a BPE
tokenizer with merges (its vocabulary loader requires them). Rows in whole 32-blocks so that Q8_0 covers every
matrix.

Measured (fp32 file, fp32 K cache, flash attention off, 1 thread): 2.4e-6 max abs over the 389 positions in one
pass and in 7-token micro-batches, 3.3e-6 token by token (2.3e-6 / 2.7e-6 with YaRN on the compressed table),
top-1 equal everywhere: fp32 rounding at this size (the V4 suites measure 1e-6 .. 5e-6), so the bound is theirs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
try:
    import llama_cpp as lc
except ImportError as e:  # an optional dependency: CI has none
    pytest.skip(f"llama.cpp's Python binding is not importable ({e})", allow_module_level=True)
from v4_models import CSA, HCA, SW, YARN, save_hf_v4  # noqa: E402

from mlaserve.gguf.convert.convert import convert_hf_to_gguf  # noqa: E402

BOUND = 1e-5  # fp32 at these sizes: 1e-6 .. 5e-6 (module doc)
HCA_RATIO = 128  # llama.cpp's only HCA ratio
LLAMA_CPP_V4 = dict(
    num_hidden_layers=4,
    layer_types=[SW, CSA, HCA, CSA],  # with all_kinds' hash first layer, swiglu clamp and 3 Sinkhorn iterations
    hidden_size=64,
    num_attention_heads=4,
    head_dim=32,
    partial_rotary_factor=0.25,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=32,
    moe_intermediate_size=32,
    index_n_heads=8,
    index_head_dim=64,
    index_topk=4,  # of up to 97 CSA rows: the indexer's choice matters
    compress_rates={CSA: 4, HCA: HCA_RATIO},
    sliding_window=8,
    max_position_embeddings=1024,
    rope_scaling=dict(YARN, original_max_position_embeddings=128),  # YaRN on the compressed layers' table
)
VOCAB = 96


def bpe_tokenizer(folder: Path) -> None:
    """Byte-level BPE: 3 specials, 92 byte symbols and one merge (llama.cpp's gpt2 vocabulary needs merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())[: VOCAB - 4]
    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2} | {s: i + 3 for i, s in enumerate(symbols)}
    vocab[symbols[0] + symbols[1]] = VOCAB - 1
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[(symbols[0], symbols[1])]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(["<s>", "</s>", "<pad>"])
    tk.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def prompt() -> list[int]:
    g = torch.Generator().manual_seed(7)
    return [0, *torch.randint(3, VOCAB, (3 * HCA_RATIO + 4,), generator=g).tolist()]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import DeepseekV4ForCausalLM

    root = tmp_path_factory.mktemp("v4_llamacpp")
    save_hf_v4("all_kinds", root / "float", seed=5, **LLAMA_CPP_V4)
    bpe_tokenizer(root / "float")
    for t in ("f32", "q8_0"):
        convert_hf_to_gguf(root / "float", root / f"{t}.gguf", t)
    ref = DeepseekV4ForCausalLM.from_pretrained(root / "float", experts_implementation="eager").float().eval()
    with torch.no_grad():
        want = ref(torch.tensor([prompt()]), use_cache=False).logits[0].float()
    return root, want


_LOG = lc.llama_log_callback(lambda level, text, user_data: None)  # kept alive: llama.cpp holds the pointer


def llama_cpp_logits(path: Path, ids: list[int], per_call: int, ubatch: int = 512) -> torch.Tensor:
    """Every position's logits from llama.cpp: `per_call` tokens per llama_decode (1: token by token), micro-batches
    of `ubatch`; fp32 K cache (its default is F16), flash attention off, 1 thread. Extra weight buffers off: its
    AMX repack of Q8_0 weights aborts the deepseek4 graph on AMX CPUs (GGML_ASSERT in ggml_backend_sched)."""
    lc.llama_log_set(_LOG, None)
    lc.llama_backend_init()
    mp = lc.llama_model_default_params()
    mp.use_extra_bufts = False
    model = lc.llama_model_load_from_file(str(path).encode(), mp)
    assert model, f"llama.cpp could not load {path}"
    cp = lc.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 1024, 512, ubatch, 1
    cp.n_threads = cp.n_threads_batch = 1
    cp.type_k = cp.type_v = 0  # GGML_TYPE_F32
    cp.flash_attn_type = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = lc.llama_init_from_model(model, cp)
    batch = lc.llama_batch_init(512, 0, 1)
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    rows = []
    try:
        assert ctx, "llama_init_from_model failed"
        for start in range(0, len(ids), per_call):
            part = ids[start : start + per_call]
            for i, tok in enumerate(part):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, start + i, 1, 1
                batch.seq_id[i][0] = 0
            batch.n_tokens = len(part)
            assert lc.llama_decode(ctx, batch) == 0
            for i in range(len(part)):
                rows.append(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy())
    finally:
        lc.llama_batch_free(batch)
        if ctx:
            lc.llama_free(ctx)
        lc.llama_model_free(model)
    return torch.from_numpy(np.stack(rows))


@pytest.mark.parametrize("per_call, ubatch", [(512, 512), (512, 7), (1, 1)], ids=["one_pass", "ubatch7", "by_token"])
def test_llama_cpp_on_our_f32_file_equals_transformers(model, per_call, ubatch):
    root, want = model
    got = llama_cpp_logits(root / "f32.gguf", prompt(), per_call, ubatch)
    err = (got - want).abs().max(-1).values  # per position
    worst = int(err.argmax())
    assert err.max().item() <= BOUND, f"position {worst} (mod 4 = {worst % 4}, mod 128 = {worst % 128}): {err.max()}"
    assert (got.argmax(-1) == want.argmax(-1)).all()


def q8_0_round(x: torch.Tensor) -> torch.Tensor:
    """ggml's quantize_row_q8_0 of the activations (blocks of 32 along the last dim): d = amax / 127 kept as fp16,
    q = round(x * 127 / amax) (its x86 path rounds half to even, as torch.round), the value q * d."""
    blocks = x.reshape(-1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    q = torch.round(blocks * torch.where(amax > 0, 127 / torch.where(amax > 0, amax, 1), 0))
    return (q * (amax / 127).half().float()).reshape(x.shape)


def transformers_with_q8_0_activations(folder: Path, ids: list[int], rounded: bool) -> torch.Tensor:
    """transformers on `folder` (the Q8_0 file's weights, dequantized); `rounded`: each input of a matmul whose
    weight the file stores Q8_0 rounded as llama.cpp rounds it (ggml converts the activations of a Q8_0 matmul to
    Q8_0 blocks and multiplies integers). The file's F32 matrices (router, hc_*) and the embedding lookup (rows,
    not a matmul) keep float inputs."""
    import torch.nn.functional as F
    from transformers import DeepseekV4ForCausalLM
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4GroupedLinear

    ref = DeepseekV4ForCausalLM.from_pretrained(folder, experts_implementation="eager").float().eval()
    kept_f32 = ("mlp.gate.weight", "hc", "position_bias", "embed_tokens")
    q8 = {
        p.untyped_storage().data_ptr()
        for n, p in ref.named_parameters()
        if p.dim() >= 2 and not any(k in n for k in kept_f32)
    }
    linear = F.linear

    def rounded_linear(x, w, b=None):  # the experts call F.linear on views of their stacks: match the storage
        return linear(q8_0_round(x) if w.untyped_storage().data_ptr() in q8 else x, w, b)

    hooks = []
    if rounded:
        F.linear = rounded_linear
        for mod in ref.modules():  # o_a_proj: a grouped bmm, not F.linear
            if isinstance(mod, DeepseekV4GroupedLinear):
                hooks.append(mod.register_forward_pre_hook(lambda mod, args: (q8_0_round(args[0]),)))
    try:
        with torch.no_grad():
            return ref(torch.tensor([ids]), use_cache=False).logits[0].float()
    finally:
        F.linear = linear
        for h in hooks:
            h.remove()


def test_llama_cpp_on_our_q8_0_file_is_transformers_with_8_bit_activations(model):
    """Q8_0: llama.cpp multiplies its blocks with 8-bit activations, so the reference is transformers on the `gguf`
    package's dequantization of the file with ggml's activation rounding put in. Measured over the 389 positions:
    without the rounding the logits differ by a median 4.6e-2 (max 1.2, top-1 94.6%); with it, 9.5e-7 over the
    first 40 positions and below 1e-5 up to position 74. At 75 one activation lands within fp32 noise of a
    rounding boundary and its 8-bit code differs by one; from there the difference (2e-2) follows the attention
    that reads that token (its window, the CSA rows holding it, every position after the HCA row that pools it;
    the same pattern at token 40 of another seed). So the first 64 positions (16 CSA windows) are compared."""
    from test_gguf_convert_deepseek_v4 import dequantized, saved_tensors
    from v4_gguf import write_dequantized_folder

    root, _ = model
    ids = prompt()[:64]
    write_dequantized_folder(
        root / "float", dequantized(root / "q8_0.gguf", saved_tensors(root / "float")), root / "deq"
    )
    got = llama_cpp_logits(root / "q8_0.gguf", ids, 512)
    want = transformers_with_q8_0_activations(root / "deq", ids, rounded=True)
    err = (got - want).abs().max(-1).values
    assert err.max().item() <= BOUND, f"position {int(err.argmax())}: {err.max()}"
    assert (got.argmax(-1) == want.argmax(-1)).all()
    # the rounding is what the comparison sees: without it the same logits are far off
    plain = transformers_with_q8_0_activations(root / "deq", ids, rounded=False)
    assert (got - plain).abs().max().item() > 100 * BOUND
