"""Runs in the llama.cpp virtual environment: converts the checkpoint with the `convert_hf_to_gguf.py`
shipped in llama-cpp-python's sdist (and quantizes it with llama.cpp's quantizer), then measures batch-1 greedy
decode whenever the benchmark asks (`peer_protocol.py`)."""

import json
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from peer_protocol import serve

# What the converter imports from the sdist's vendored llama.cpp besides itself.
CONVERTER_DIRS = ("gguf-py/", "conversion/")


def converter_dir(work_dir: Path, version: str) -> Path:
    src = work_dir / f"llama.cpp-{version}"
    if (src / "convert_hf_to_gguf.py").is_file():
        return src
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={version}", "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                rel = member.name.split("/vendor/llama.cpp/", 1)
                if len(rel) == 2 and (rel[1] == "convert_hf_to_gguf.py" or rel[1].startswith(CONVERTER_DIRS)):
                    member.name = rel[1]
                    tar.extract(member, src, filter="data")
    return src


CONVERT = """
import sys
sys.path.insert(0, {gguf_py!r})
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outfile", {out!r}, "--outtype", {outtype!r}]
sys.path.insert(0, {src!r})
import convert_hf_to_gguf as c
# Our byte-level BPE uses GPT-2's pre-tokenizer; the converter only knows tokenizers by a hash.
for module in list(sys.modules.values()):
    for cls in list(vars(module).values()) if module is not None else []:
        if isinstance(cls, type) and "get_vocab_base_pre" in vars(cls):
            cls.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
c.main()
"""


# Our dtype names -> llama.cpp's file types (llama_ftype); the quantized ones are made with llama-quantize's API.
FTYPES = {"fp32": "LLAMA_FTYPE_ALL_F32", "bf16": "LLAMA_FTYPE_MOSTLY_BF16", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
          "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1"}


def ensure_gguf(model: str, dtype: str, work_dir: Path, version: str) -> Path:
    """The checkpoint as a GGUF file of `dtype`: an HF directory converted with llama.cpp's script, a GGUF file
    (or a conversion) requantized with llama.cpp's own quantizer."""
    out = work_dir / "gguf" / f"{Path(model).stem}-{dtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if model.endswith(".gguf"):
        return quantize(Path(model), out, dtype)
    float_type = dtype if dtype in ("bf16", "fp32") else "bf16"
    converted = out if float_type == dtype else out.with_name(f"{Path(model).stem}-{float_type}.gguf")
    if not converted.is_file():
        src = converter_dir(work_dir, version)
        code = CONVERT.format(gguf_py=str(src / "gguf-py"), model=model, out=str(converted),
                              outtype={"bf16": "bf16", "fp32": "f32"}[float_type], src=str(src))
        subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.DEVNULL)
    return converted if converted == out else quantize(converted, out, dtype)


def quantize(source: Path, out: Path, dtype: str) -> Path:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[dtype])
    params.allow_requantize = True  # a quantized source (SmolLM2 ships as Q4_1) is requantized from its values
    params.nthread = 2  # once per checkpoint, not measured
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {dtype}")
    return out


def decode_rate(llm, prompt: list[int], n: int) -> float:
    llm.reset()
    first = None
    for produced, _ in enumerate(llm.generate(prompt, temp=0.0, top_k=1), start=1):
        if first is None:
            first = time.perf_counter()
        if produced == n:
            break
    return (n - 1) / (time.perf_counter() - first)


def main(path: str) -> None:
    import llama_cpp

    spec = json.loads(Path(path).read_text())
    gguf = ensure_gguf(spec["model_dir"], spec["dtype"], Path(spec["work_dir"]), llama_cpp.__version__)
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=1024, n_threads=spec["threads"], n_batch=512, verbose=False)
    prompt, n = spec["batch1"]["prompts"][0], spec["batch1"]["output_lens"][0]
    decode_rate(llm, prompt, 4)  # warm-up
    serve(llama_cpp.__version__,
          {"batch1": lambda request: [decode_rate(llm, prompt, n) for _ in range(request["repeats"])]})


if __name__ == "__main__":
    main(sys.argv[1])
