"""GGUF checkpoints: greedy output equals HF transformers loading the same file (float32), for the shipped
SmolLM2 file and for small files written in each tensor type we read, Llama and Qwen2; files and directories
resolve; what we cannot serve is refused by name."""

from __future__ import annotations

import shutil

import gguf
import pytest
import torch

from gpu_worker.engine import LLM, ModelLoadError, SamplingParams
from gpu_worker.engine.checkpoint import open_checkpoint
from gpu_worker.engine.kernels import quant_cpu_kernels
from gpu_worker.engine.packaged_models import packaged_model_path
from gpu_worker.engine.quantization.kernels import CpuInt4LinearKernel, CpuInt8LinearKernel, DequantLinearKernel
from tests.conftest import DEVICE
from tests.gguf_files import write_gguf

T = gguf.GGMLQuantizationType
SMOLLM2 = "smollm2-135m-instruct"
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "How many legs does a spider have?"]
PROMPTS = [[11, 400, 23, 900, 5, 77, 310], list(range(100, 160)), [7] * 20 + [8, 9]]


def hf_gguf_greedy(path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model = model.to(DEVICE).eval()
    model.generation_config.eos_token_id = None  # run on past EOS as ours does with ignore_eos (min_new_tokens
    outs = []                                    # would instead forbid EOS and change the argmax)
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=DEVICE)
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                                 pad_token_id=0)
            outs.append(gen[0, len(prompt):].tolist())
    return outs


def float32_llm(model: str) -> LLM:
    return LLM(model, dtype="float32", device=DEVICE, kv_cache_memory_bytes=64 << 20, max_model_len=1024)


def ours_greedy(model: str | LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    llm = float32_llm(model) if isinstance(model, str) else model
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    return [out.token_ids for out in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    """small_checkpoint(arch) -> an HF directory with a 1 000-token vocabulary (GGUF readers parse the vocabulary
    token by token: the built-ins' 32 000 would take most of each test) and hidden size 256 (K-quant rows hold
    multiples of 256 values)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from gpu_worker.engine.builtin_models import CHAT_TEMPLATE, SPECIAL_TOKENS, training_corpus

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(training_corpus(2000), trainers.BpeTrainer(
        vocab_size=1000, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=SPECIAL_TOKENS[0],
                                                     eos_token=SPECIAL_TOKENS[3], chat_template=CHAT_TEMPLATE)
    made = {}

    def make(arch: str):
        if arch not in made:
            config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                                     "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[arch]
            config = getattr(transformers, config_cls)(
                vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, hidden_size=256,
                intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=1024, initializer_range=0.2)
            torch.manual_seed(len(made) + 1)
            made[arch] = tmp_path_factory.mktemp(arch)
            getattr(transformers, model_cls)(config).save_pretrained(made[arch])
            tokenizer.save_pretrained(made[arch])
        return made[arch]

    return make


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2 loaded once for this module (float32: the exactness comparison's dtype)."""
    return float32_llm(SMOLLM2)


def test_the_shipped_smollm2_file_greedy_equals_hf_loading_the_same_file(smollm2):
    tokenizer = open_checkpoint(SMOLLM2).tokenizer()  # built independently of the engine's
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    assert ours_greedy(smollm2, prompts, 32) == hf_gguf_greedy(packaged_model_path(SMOLLM2), prompts, 32)


def test_smollm2_answers_a_factual_question(smollm2):
    prompt = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in smollm2.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16))[0].text


@pytest.mark.parametrize("tensor_type", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_written_gguf_file_greedy_equals_hf_loading_it(small_checkpoint, tmp_path, arch, tensor_type):
    path = write_gguf(small_checkpoint(arch), tmp_path / f"{arch}-{tensor_type.name}.gguf", tensor_type)
    assert ours_greedy(str(path), PROMPTS, 16) == hf_gguf_greedy(path, PROMPTS, 16)


@pytest.mark.parametrize(("tensor_type", "dtype"), [(T.F32, torch.float32), (T.Q8_0, torch.bfloat16),
                                                    (T.Q4_K, torch.bfloat16)], ids=lambda t: str(t))
def test_auto_dtype_follows_a_float_file_and_serves_quantized_ones_in_bfloat16(small_checkpoint, tmp_path,
                                                                             tensor_type, dtype):
    path = write_gguf(small_checkpoint("llama"), tmp_path / "model.gguf", tensor_type)
    assert open_checkpoint(path).config.checkpoint_dtype == dtype


def test_a_directory_holding_one_gguf_file_serves_it(small_checkpoint, tmp_path):
    path = write_gguf(small_checkpoint("qwen2"), tmp_path / "model.gguf", T.F32)
    assert ours_greedy(str(tmp_path), PROMPTS[:1], 8) == ours_greedy(str(path), PROMPTS[:1], 8)


def test_a_directory_holding_two_gguf_files_names_both(small_checkpoint, tmp_path):
    path = write_gguf(small_checkpoint("qwen2"), tmp_path / "a.gguf", T.F32)
    shutil.copy(path, tmp_path / "b.gguf")
    with pytest.raises(ModelLoadError, match=r"a\.gguf, b\.gguf"):
        open_checkpoint(tmp_path)


def test_an_unsupported_gguf_architecture_is_named(tmp_path):
    writer = gguf.GGUFWriter(tmp_path / "phi.gguf", "phi3")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="phi3"):
        open_checkpoint(tmp_path / "phi.gguf")


def test_a_file_that_is_not_gguf_is_refused_clearly(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        open_checkpoint(tmp_path / "model.gguf")


def test_loading_writes_nothing_next_to_the_users_file(small_checkpoint, tmp_path):
    path = write_gguf(small_checkpoint("llama"), tmp_path / "model.gguf", T.Q8_0)
    ours_greedy(str(path), PROMPTS[:1], 4)
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_gguf_file_quantizes_to_a_directory_serving_what_load_time_int8_serves(small_checkpoint, tmp_path, arch):
    from gpu_worker.engine.quantization.convert import quantize_checkpoint

    path = write_gguf(small_checkpoint(arch), tmp_path / "model.gguf", T.F32)
    done = quantize_checkpoint(str(path), "int8", tmp_path / "int8")
    load_time = LLM(str(path), dtype="float32", device=DEVICE, kv_cache_memory_bytes=64 << 20, quantization="int8")
    assert ours_greedy(str(done.out), PROMPTS, 16) == ours_greedy(load_time, PROMPTS, 16)
    assert open_checkpoint(done.out).tokenizer().encode("hello world") == load_time.tokenizer.encode("hello world")


@pytest.mark.parametrize("tensor_type", [T.Q8_0, T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_q8_0_and_q4_matrices_arrive_quantized_and_dequantize_to_ggmls_values(small_checkpoint, tmp_path,
                                                                             tensor_type):
    from gpu_worker.engine.gguf.quantized import native_weight

    path = write_gguf(small_checkpoint("llama"), tmp_path / "model.gguf", tensor_type)
    matrices = [t for t in gguf.GGUFReader(path).tensors if t.tensor_type == tensor_type]
    assert matrices
    for tensor in matrices:
        weight = native_weight(tensor)
        assert weight.bits == (8 if tensor_type == T.Q8_0 else 4) and weight.group_size == 32
        reference = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
        assert torch.equal(weight.dequantize(), reference.reshape(weight.shape)), tensor.name


@pytest.mark.parametrize(("tensor_type", "bits"), [(T.Q8_0, 8), (T.Q4_0, 4), (T.Q4_1, 4)], ids=lambda t: str(t))
def test_a_quantized_gguf_file_serves_its_own_weights_in_bfloat16(small_checkpoint, tmp_path, tensor_type, bits):
    path = write_gguf(small_checkpoint("qwen2"), tmp_path / "model.gguf", tensor_type)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def prompt_logprobs(llm):
        return torch.tensor([v for out in llm.generate(PROMPTS, params) for v in out.prompt_logprobs[1:]])

    served = LLM(str(path), device=DEVICE, kv_cache_memory_bytes=64 << 20)
    model = served.engine.runner.model
    down = model.layers[0].mlp.down_proj
    assert down.weight is None  # no dense copy: the kernel holds the file's weight
    if quant_cpu_kernels() is None:
        assert isinstance(down.kernel, DequantLinearKernel) and down.kernel.weight.bits == bits
    else:
        assert isinstance(down.kernel, CpuInt8LinearKernel if bits == 8 else CpuInt4LinearKernel)
    # Against the same weights dense in float32 (the reference dtype dequantizes them at load), serving them
    # quantized in bf16 is about as close as serving a dense bf16 copy (`tokenfleet quantize --method bf16`) is:
    # 1.4-1.8x its error on a Zen 5, where the VNNI GEMM quantizes prefill's activations per run of 32 too, and up to
    # 2.2x for Q4_0 from run to run on a Zen 4 host; a misplaced weight is off by far more.
    from gpu_worker.engine.quantization.convert import quantize_checkpoint

    reference = prompt_logprobs(float32_llm(str(path)))
    dense = LLM(str(quantize_checkpoint(str(path), "bf16", tmp_path / "bf16").out), device=DEVICE,
                kv_cache_memory_bytes=64 << 20)
    dense_error = (prompt_logprobs(dense) - reference).abs().mean()
    assert (prompt_logprobs(served) - reference).abs().mean() <= 2.5 * dense_error
