"""`tokenfleet quantize`: a dense checkpoint becomes a quantized directory that serves with no flag."""

from __future__ import annotations

import json

import pytest
import torch

from gpu_worker.engine import LLM, SamplingParams
from gpu_worker.engine.quantization.methods import WeightQuantizer
from gpu_worker.engine.quantization.weights import Int4Weight, Int8Weight
from gpu_worker.quantize.awq import best_scale, scale_groups
from gpu_worker.quantize.convert import _calibration_inputs, quantize_checkpoint
from services.launcher.cli import main as tokenfleet
from services.text.errors import ModelLoadError

PROMPTS = [[5, 17, 42, 9, 33, 2, 71, 8, 120, 7], [90, 3, 3, 14]]
LOGPROBS = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)


def prompt_logprobs(llm: LLM) -> torch.Tensor:
    return torch.tensor([v for o in llm.generate(PROMPTS, LOGPROBS) for v in o.prompt_logprobs[1:]])


# phi4-mini: its q/k rows reordered for partial rotary go back in the checkpoint's order; qwen3-moe: experts and a
# dense layer, the router kept dense. (phi4-mini keeps its own shape: its rotary factors are per head size.)
@pytest.mark.parametrize("arch", ["llama", "llama-tied", "qwen2", "phi4-mini", "qwen3-moe"])
def test_int8_directory_serves_what_load_time_int8_serves(make_checkpoint, tmp_path, arch):
    src = make_checkpoint(arch, **({} if arch == "phi4-mini" else dict(hidden_size=128, intermediate_size=256)))
    done = quantize_checkpoint(str(src), "int8", tmp_path / "int8")
    config = json.loads((done.out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "tokenfleet", "bits": 8, "group_size": None}
    served = LLM(str(done.out), dtype="float32")  # no flag: the directory says how it is quantized
    assert isinstance(served.engine.runner.model.layers[-1].mlp.down_proj.kernel.weight, Int8Weight)
    torch.testing.assert_close(prompt_logprobs(served),
                               prompt_logprobs(LLM(str(src), dtype="float32", quantization="int8")))


def test_int4_directory_is_under_three_tenths_of_bf16_and_close_to_the_dense_model(make_checkpoint, tmp_path):
    # Weights of a trained model's scale: with larger random ones, the logits are too peaked to compare.
    src = make_checkpoint("llama", hidden_size=256, intermediate_size=512, initializer_range=0.02)
    done = quantize_checkpoint(str(src), "int4", tmp_path / "int4")
    assert done.quantized_bytes / done.bf16_bytes < 0.30
    assert set(done.alphas) == {f"layers.{i}.{m}" for i in range(2) for m in
                                ("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj")}
    served = LLM(str(done.out), dtype="float32")
    assert isinstance(served.engine.runner.model.layers[0].mlp.gate_up_proj.kernel.weight, Int4Weight)
    dense = prompt_logprobs(LLM(str(src), dtype="float32"))
    assert (prompt_logprobs(served) - dense).abs().mean() < 0.02 * dense.abs().mean()


def test_an_int4_table_shrinks_a_tied_model_and_the_lm_head_reads_it(make_checkpoint, tmp_path):
    # llama.cpp's --token-embedding-type: by default a tied table stays int8 under int4 (every logit sees it).
    src = make_checkpoint("llama-tied", hidden_size=256, intermediate_size=512, initializer_range=0.02)
    default = quantize_checkpoint(str(src), "int4", tmp_path / "int8-table")
    smaller = quantize_checkpoint(str(src), "int4", tmp_path / "int4-table", table="int4")
    assert smaller.quantized_bytes < default.quantized_bytes
    model = LLM(str(smaller.out), dtype="float32").engine.runner.model
    assert isinstance(model.embed_tokens.quantized, Int4Weight)
    assert model.lm_head.kernel.weight.packed.data_ptr() == model.embed_tokens.quantized.packed.data_ptr()  # shared
    with pytest.raises(ValueError, match="table's method"):
        quantize_checkpoint(str(src), "int4", tmp_path / "bad", table="int2")


def test_folding_scales_keeps_the_dense_models_function(make_checkpoint):
    llm = LLM(str(make_checkpoint("llama-tied")), dtype="float32")
    before = prompt_logprobs(llm)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for group in scale_groups(llm.engine.runner.model):
            s = torch.rand(group.weight.shape[1], generator=generator) + 0.5
            group.weight.mul_(s)
            group.fold(s)
    torch.testing.assert_close(prompt_logprobs(llm), before, rtol=1e-4, atol=1e-4)


def test_activation_aware_scales_beat_round_to_nearest_on_outlier_channels():
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(256, 256, generator=generator)
    x = torch.randn(512, 256, generator=generator)
    x[:, :4] *= 30  # a few channels carry most of the activation, as in trained LLMs
    quantizer = WeightQuantizer("int4", 128)
    s, alpha = best_scale(w, x, quantizer.fake)
    rtn = (x @ quantizer.fake(w).T - x @ w.T).pow(2).mean()
    awq = (x @ (quantizer.fake(w * s) / s).T - x @ w.T).pow(2).mean()
    assert alpha > 0 and awq < 0.8 * rtn


def test_an_already_quantized_directory_is_refused(make_checkpoint, tmp_path):
    done = quantize_checkpoint(str(make_checkpoint("llama")), "int8", tmp_path / "int8")
    with pytest.raises(ModelLoadError, match="already quantized"):
        quantize_checkpoint(str(done.out), "int4", tmp_path / "again")


def test_the_console_command_writes_a_servable_directory(make_checkpoint, tmp_path, capsys):
    out = tmp_path / "cli"
    assert tokenfleet(["quantize", "--model", str(make_checkpoint("qwen2")), "--method", "int8",
                       "--out", str(out)]) == 0
    assert "x of bf16" in capsys.readouterr().out
    assert LLM(str(out)).generate(PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0].token_ids


def test_awq_calibration_captures_every_token_in_every_layers_groups(make_checkpoint):
    """The last layer runs the sampled row alone when serving; calibration needs all of its tokens there too."""
    llm = LLM(str(make_checkpoint("llama", hidden_size=128, intermediate_size=256)), dtype="float32")
    text = "the quick brown fox jumps over the lazy dog " * 4
    tokens = len(llm.tokenizer.encode(text))
    captured = _calibration_inputs(llm, text)
    assert {g.name for g in scale_groups(llm.engine.runner.model)} == set(captured)
    assert {name: rows.shape[0] for name, rows in captured.items()} == dict.fromkeys(captured, tokens)
