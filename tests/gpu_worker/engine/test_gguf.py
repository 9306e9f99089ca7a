"""GGUF checkpoints: greedy output equals HF transformers loading the same file (float32), for the shipped
SmolLM2 file and for small files written in each tensor type we read, Llama, Qwen2 and Qwen3; a float32 file
written from an HF directory serves what HF serves from the directory, rotary scaling included (Llama 3's as
llama.cpp's rope_freqs, YaRN), and so do mixtures of experts (qwen3moe files, Mixtral's as llama files with
experts); stacked experts arrive one per expert, quantized ones quantized; files and directories resolve; what we
cannot serve is refused by name."""

from __future__ import annotations

import shutil

import gguf
import pytest
import torch

from gpu_worker.engine import LLM, ModelLoadError, SamplingParams
from gpu_worker.engine.checkpoint import open_checkpoint
from gpu_worker.engine.kernels import quant_cpu_kernels
from gpu_worker.engine.quantization.kernels import CpuInt4LinearKernel, CpuInt8LinearKernel, DequantLinearKernel
from gpu_worker.engine.quantization.weights import QuantizedWeight
from services.text.packaged_models import packaged_model_path
from tests.conftest import ARCHITECTURES, DEVICE
from tests.gguf_files import write_gguf

T = gguf.GGMLQuantizationType
SMOLLM2 = "smollm2-135m-instruct"
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]
PROMPTS = [[11, 400, 23, 900, 5, 77, 310], list(range(100, 160)), [7] * 20 + [8, 9]]
# Past the scaled checkpoints' original contexts (256 positions for llama3-rope, 128 for yarn).
LONG_PROMPTS = [list(range(10, 310)), [(37 * i) % 900 + 50 for i in range(280)]]
# transformers' GGUF loader reads no head_dim for qwen3 files and takes Qwen3Config's default, 128 (Qwen3's own
# 0.6B to 8B have it): small Qwen3 checkpoints use it so that HF reads their files back right.
QWEN3_HEAD_DIM = 128
# A qwen3moe file has every layer sparse and its top k renormalised (llama.cpp's graph), which conftest's qwen3-moe
# (a dense second layer, weights as the softmax gave them) is not: `write_gguf` refuses it as it stands.
GGUF_OVERRIDES = {"qwen3-moe": {"mlp_only_layers": [], "norm_topk_prob": True}}


def hf_greedy_loading(path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """HF generate (float32) from `path`: a GGUF file or an HF directory."""
    from transformers import AutoModelForCausalLM

    if path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
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


def prompt_logprobs(llm: LLM) -> torch.Tensor:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    return torch.tensor([v for out in llm.generate(PROMPTS, params) for v in out.prompt_logprobs[1:]])


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    """small_checkpoint(arch, **config overrides) -> an HF directory of one of conftest's ARCHITECTURES (with
    GGUF_OVERRIDES) with a 1 000-token vocabulary (GGUF readers parse the vocabulary token by token: the built-ins'
    32 000 would take most of each test) and hidden size 256 (K-quant rows hold multiples of 256 values)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from services.text.builtin_models import CHAT_TEMPLATE, SPECIAL_TOKENS, training_corpus

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(training_corpus(2000), trainers.BpeTrainer(
        vocab_size=1000, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=SPECIAL_TOKENS[0],
                                                     eos_token=SPECIAL_TOKENS[3], chat_template=CHAT_TEMPLATE)
    made = {}

    def make(arch: str, **extra):
        key = (arch, repr(sorted(extra.items())))  # overrides may hold lists
        if key not in made:
            config_cls, model_cls, overrides = ARCHITECTURES[arch]
            overrides = {**overrides, **GGUF_OVERRIDES.get(arch, {}), **extra}
            if model_cls == "Qwen3ForCausalLM":
                overrides = {**overrides, "head_dim": QWEN3_HEAD_DIM}
            config = getattr(transformers, config_cls)(**{
                "vocab_size": len(tokenizer), "eos_token_id": tokenizer.eos_token_id, "hidden_size": 256,
                "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 1024, "initializer_range": 0.2, **overrides})
            torch.manual_seed(len(made) + 1)
            made[key] = tmp_path_factory.mktemp(arch)
            getattr(transformers, model_cls)(config).save_pretrained(made[key])
            tokenizer.save_pretrained(made[key])
        return made[key]

    return make


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2 loaded once for this module (float32: the exactness comparison's dtype)."""
    return float32_llm(SMOLLM2)


def test_the_shipped_smollm2_file_greedy_equals_hf_loading_the_same_file(smollm2):
    tokenizer = open_checkpoint(SMOLLM2).tokenizer()  # built independently of the engine's
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    assert ours_greedy(smollm2, prompts, 24) == hf_greedy_loading(packaged_model_path(SMOLLM2), prompts, 24)


def test_smollm2_answers_a_factual_question(smollm2):
    prompt = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in smollm2.generate(prompt, SamplingParams(temperature=0.0, max_tokens=16))[0].text


ALL_TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q6_K]


# No mixture here: transformers' GGUF loader (5.25) reads a qwen3moe file's experts at Qwen3MoeConfig's default
# width (it maps no expert_feed_forward_length) and fails on them, and reads a llama file with experts (Mixtral's) as
# a dense Llama. Mixtures are compared with their HF directories instead (float32 files, whose weights are the
# directory's), and a quantized mixture with its own dequantized weights.
# Every tensor type on llama's file; qwen2's and qwen3's (their own metadata and tensors, the same decoders) on a
# float, a legacy and a k-quant type.
@pytest.mark.parametrize(("arch", "tensor_type"), [("llama", t) for t in ALL_TYPES]
                         + [(arch, t) for arch in ("qwen2", "qwen3") for t in (T.F32, T.Q8_0, T.Q4_K)],
                         ids=lambda v: getattr(v, "name", v))
def test_a_written_gguf_file_greedy_equals_hf_loading_it(small_checkpoint, tmp_path, arch, tensor_type):
    path = write_gguf(small_checkpoint(arch), tmp_path / f"{arch}-{tensor_type.name}.gguf", tensor_type)
    assert ours_greedy(str(path), PROMPTS, 16) == hf_greedy_loading(path, PROMPTS, 16)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama3-rope", "yarn", "qwen3-moe", "mixtral"])
def test_a_float32_gguf_file_greedy_equals_its_hf_directory(small_checkpoint, tmp_path, arch):
    """The file's weights are the directory's exactly, so HF's own model is the reference; transformers' GGUF loader
    would drop the rotary scaling."""
    model_dir = small_checkpoint(arch)
    path = write_gguf(model_dir, tmp_path / f"{arch}.gguf", T.F32)
    prompts = PROMPTS + LONG_PROMPTS
    assert ours_greedy(str(path), prompts, 16) == hf_greedy_loading(model_dir, prompts, 16)


def test_llama3_scaling_arrives_as_llama_cpps_rope_freqs_giving_hfs_frequencies(small_checkpoint, tmp_path):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from gpu_worker.engine.rope import RotaryEmbedding

    model_dir = small_checkpoint("llama3-rope")
    path = write_gguf(model_dir, tmp_path / "model.gguf", T.F32)
    assert "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(path).tensors}
    config = open_checkpoint(path).config
    assert config.rope_scaling["rope_type"] == "freq_factors"
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.from_pretrained(model_dir), "cpu")
    served = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling).inv_freq
    torch.testing.assert_close(served, expected, rtol=1e-6, atol=0)  # one division where HF does three operations


# A mixture's router is float32 in every file: a float16 mixture still serves in float16.
@pytest.mark.parametrize(("arch", "tensor_type", "dtype"), [
    ("llama", T.F32, torch.float32), ("llama", T.Q8_0, torch.bfloat16), ("llama", T.Q4_K, torch.bfloat16),
    ("mixtral", T.F16, torch.float16)], ids=lambda t: str(t))
def test_auto_dtype_follows_a_float_file_and_serves_quantized_ones_in_bfloat16(small_checkpoint, tmp_path, arch,
                                                                             tensor_type, dtype):
    path = write_gguf(small_checkpoint(arch), tmp_path / "model.gguf", tensor_type)
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
    writer = gguf.GGUFWriter(tmp_path / "phi.gguf", "phi2")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="phi2"):
        open_checkpoint(tmp_path / "phi.gguf")


def hyperparameters_file(path, arch: str, **keys):
    """A GGUF file of `arch` with the hyper-parameters a config needs, `keys` (GGUFWriter.add_<key>(value)) and
    an embedding table, and no other tensor: enough for `open_checkpoint(path).config`."""
    writer = gguf.GGUFWriter(path, arch)
    keys = {"embedding_length": 8, "head_count": 2, "block_count": 1, "feed_forward_length": 16,
            "layer_norm_rms_eps": 1e-5, "context_length": 64, **keys}
    for key, value in keys.items():
        getattr(writer, f"add_{key}")(value)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unsupported_gguf_rope_scaling_is_named(tmp_path):
    path = hyperparameters_file(tmp_path / "longrope.gguf", "llama", rope_scaling_type=gguf.RopeScalingType.LONGROPE)
    with pytest.raises(ModelLoadError, match="longrope"):
        open_checkpoint(path)


def test_a_file_that_is_not_gguf_is_refused_clearly(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        open_checkpoint(tmp_path / "model.gguf")


def test_loading_writes_nothing_next_to_the_users_file(small_checkpoint, tmp_path):
    path = write_gguf(small_checkpoint("llama"), tmp_path / "model.gguf", T.Q8_0)
    ours_greedy(str(path), PROMPTS[:1], 4)
    assert [p.name for p in tmp_path.iterdir()] == ["model.gguf"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama3-rope", "yarn", "qwen3-moe", "mixtral"])
def test_a_gguf_file_quantizes_to_a_directory_serving_what_load_time_int8_serves(small_checkpoint, tmp_path, arch):
    from gpu_worker.quantize.convert import quantize_checkpoint

    path = write_gguf(small_checkpoint(arch), tmp_path / "model.gguf", T.F32)
    done = quantize_checkpoint(str(path), "int8", tmp_path / "int8")
    load_time = LLM(str(path), dtype="float32", device=DEVICE, kv_cache_memory_bytes=64 << 20, quantization="int8")
    prompts = PROMPTS + LONG_PROMPTS  # the directory keeps the file's rotary scaling
    assert ours_greedy(str(done.out), prompts, 16) == ours_greedy(load_time, prompts, 16)
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
    from gpu_worker.quantize.convert import quantize_checkpoint

    reference = prompt_logprobs(float32_llm(str(path)))
    dense = LLM(str(quantize_checkpoint(str(path), "bf16", tmp_path / "bf16").out), device=DEVICE,
                kv_cache_memory_bytes=64 << 20)
    dense_error = (prompt_logprobs(dense) - reference).abs().mean()
    assert (prompt_logprobs(served) - reference).abs().mean() <= 2.5 * dense_error


# ---- mixtures of experts ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tensor_type", ALL_TYPES, ids=lambda t: t.name)
def test_stacked_experts_arrive_one_per_expert_with_ggmls_values(small_checkpoint, tmp_path, tensor_type):
    """Mixtral's experts are 256 and 512 wide: every type stores them in its own blocks (none falls back to Q8_0)."""
    from gpu_worker.engine.gguf.quantized import NATIVE_TYPES

    path = write_gguf(small_checkpoint("mixtral"), tmp_path / "model.gguf", tensor_type)
    weights = dict(open_checkpoint(path).tensors())
    stacked = [t for t in gguf.GGUFReader(path).tensors if t.name.endswith("_exps.weight")]
    assert {t.tensor_type for t in stacked} == {tensor_type}
    projections = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
    for tensor in stacked:
        layer, part = tensor.name.split(".")[1:3]
        reference = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
        for expert, values in enumerate(reference):
            weight = weights.pop(f"model.layers.{layer}.mlp.experts.{expert}.{projections[part]}.weight")
            assert isinstance(weight, QuantizedWeight) == (tensor_type in NATIVE_TYPES)
            dense = weight.dequantize() if isinstance(weight, QuantizedWeight) else weight
            assert torch.equal(dense, values), (tensor.name, expert)
    assert not [name for name in weights if ".experts." in name]  # no expert more than the file holds


def test_a_q8_0_mixtures_experts_arrive_quantized_and_serve_in_bfloat16(small_checkpoint, tmp_path):
    from safetensors.torch import save_file

    model_dir = small_checkpoint("qwen3-moe")
    path = write_gguf(model_dir, tmp_path / "model.gguf", T.Q8_0)
    served = LLM(str(path), device=DEVICE, kv_cache_memory_bytes=64 << 20)
    model = served.engine.runner.model
    assert model.norm.weight.dtype == torch.bfloat16
    experts = [linear for layer in model.layers for expert in layer.mlp.experts
               for linear in (expert.gate_up_proj, expert.down_proj)]
    assert len(experts) == 2 * 2 * 8
    for linear in experts:
        assert linear.weight is None  # no dense copy: the kernel holds the file's weight
        if quant_cpu_kernels() is None:
            assert isinstance(linear.kernel, DequantLinearKernel) and linear.kernel.weight.bits == 8
        else:
            assert isinstance(linear.kernel, CpuInt8LinearKernel)
    # As for dense files: against the file's weights dense in float32, serving them quantized in bf16 is about as
    # close as serving them dense in bf16 (here the directory with the file's values in place of its own).
    twin = tmp_path / "dense"
    shutil.copytree(model_dir, twin)
    save_file({name: (w.dequantize() if isinstance(w, QuantizedWeight) else w).contiguous()
               for name, w in open_checkpoint(path).tensors()}, twin / "model.safetensors")
    reference = prompt_logprobs(float32_llm(str(path)))
    dense = LLM(str(twin), dtype="bfloat16", device=DEVICE, kv_cache_memory_bytes=64 << 20)
    dense_error = (prompt_logprobs(dense) - reference).abs().mean()
    assert (prompt_logprobs(served) - reference).abs().mean() <= 2.5 * dense_error


@pytest.mark.parametrize(("keys", "renormalize"), [({}, True), ({"expert_weights_norm": False}, False)],
                         ids=["absent", "false"])
def test_a_qwen3moe_file_renormalises_the_top_k_unless_it_says_not(tmp_path, keys, renormalize):
    """llama.cpp's qwen3moe graph always renormalises, and the converter writes no key for it; a file carrying
    `expert_weights_norm` (converters write it for the models whose HF config makes it optional) is followed."""
    path = hyperparameters_file(tmp_path / "moe.gguf", "qwen3moe", expert_count=4, expert_used_count=2,
                                expert_feed_forward_length=32, **keys)
    config = open_checkpoint(path).config
    assert config.architecture == "Qwen3MoeForCausalLM" and config.moe.renormalize is renormalize
    assert (config.moe.num_experts, config.moe.experts_per_token, config.moe.expert_intermediate_size) == (4, 2, 32)
    assert not config.moe.dense_layers


def test_a_llama_file_with_experts_is_mixtral_renormalising_its_top_k(tmp_path):
    path = hyperparameters_file(tmp_path / "mixtral.gguf", "llama", expert_count=4, expert_used_count=2)
    config = open_checkpoint(path).config
    assert config.architecture == "MixtralForCausalLM" and config.moe.renormalize
    assert config.moe.expert_intermediate_size == config.intermediate_size  # Mixtral's experts are the FFN's width


def test_a_qwen3_moe_directory_with_dense_layers_has_no_gguf_file(small_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="every layer must be sparse"):
        write_gguf(small_checkpoint("qwen3-moe", mlp_only_layers=[1]), tmp_path / "model.gguf", T.F32)
