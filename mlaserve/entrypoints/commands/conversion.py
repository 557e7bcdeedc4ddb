"""`mlaserve convert`: a Hugging Face MLA or DeepSeek-V4 checkpoint written as a GGUF file llama.cpp loads."""

from __future__ import annotations


def add(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="write a Hugging Face MLA or DeepSeek-V4 checkpoint as a GGUF file llama.cpp loads",
        description="Convert HF_DIR (config.json, *.safetensors, tokenizer.json) to OUT.gguf in "
        "llama.cpp's MLA layout, or its deepseek4 layout for a DeepSeek-V4 folder (what its "
        "convert_hf_to_gguf.py writes).",
    )
    p.add_argument("hf_dir", metavar="HF_DIR")
    p.add_argument("out", metavar="OUT.gguf")
    p.add_argument(
        "--outtype",
        default="f16",
        choices=["f32", "f16", "bf16", "q8_0"],
        help="type of the weight matrices (default f16); norms, biases and routers stay f32",
    )
    p.add_argument("--name", default=None, help="general.name (default: from the folder name)")
    p.add_argument(
        "--pre-tokenizer",
        default=None,
        metavar="NAME",
        help="tokenizer.ggml.pre when it is not recognized (e.g. deepseek-v3, glm4, gpt-2)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from mlaserve.gguf.convert.convert import convert_hf_to_gguf
    from mlaserve.gguf.read.checkpoint import load_gguf

    report = convert_hf_to_gguf(args.hf_dir, args.out, args.outtype, name=args.name, pre_tokenizer=args.pre_tokenizer)
    counts = ", ".join(f"{n} {t}" for t, n in sorted(report.type_counts().items()))
    print(f"wrote {report.path} ({report.arch}, {len(report.tensors)} tensors: {counts})")
    for note in report.notes:
        print(f"  note: {note}")
    if report.arch != "deepseek4":  # a deepseek4 file is read back inside its converter (config compared)
        load_gguf(report.path).close()  # our reader maps it back onto the config (k_b/v_b orientation checked)
    return 0
