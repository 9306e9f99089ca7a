"""Loading real HF checkpoint directories: layouts, dtypes, and clear refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from gpu_worker.engine import LLM, ModelLoadError, SamplingParams
from gpu_worker.engine.model_config import ModelConfig, resolve_dtype

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = [11, 400, 23, 9000, 5, 77, 31000]


def _copy(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_gives_the_same_tokens(make_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    single = make_checkpoint("qwen2")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(single).save_pretrained(sharded, max_shard_size="1MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(single / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").is_file()
    expected = LLM(str(single), dtype="float32").generate(PROMPT, GREEDY)[0].token_ids
    assert LLM(str(sharded), dtype="float32").generate(PROMPT, GREEDY)[0].token_ids == expected


def test_unknown_architecture_is_named(make_checkpoint, tmp_path):
    model = _copy(make_checkpoint("llama"), tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="GPTNeoXForCausalLM"):
        LLM(str(model))


def test_missing_weights_are_named(make_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    model = _copy(make_checkpoint("llama"), tmp_path)
    weights = load_file(model / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.down_proj"):
        LLM(str(model))


def test_missing_directory_names_the_builtins():
    with pytest.raises(ModelLoadError, match="tokenfleet-small"):
        LLM("/nonexistent/model")


def test_a_sliding_window_model_serves_every_position_of_the_model(make_checkpoint):
    model = make_checkpoint("mistral", sliding_window=64)
    assert LLM(str(model), dtype="float32").engine.max_model_len == 1024  # TINY's max_position_embeddings


def test_unsupported_rope_scaling_is_refused(make_checkpoint, tmp_path):
    model = _copy(make_checkpoint("llama"), tmp_path)
    config = json.loads((model / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
                                 "original_max_position_embeddings": 256, "rope_theta": 10000.0}
    (model / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="longrope"):
        LLM(str(model))


@pytest.mark.parametrize(("checkpoint", "device", "expected"), [
    (torch.float32, "cpu", torch.float32),
    (torch.bfloat16, "cpu", torch.bfloat16),
    (torch.float16, "cpu", torch.bfloat16),  # fp16 matmul on CPU is ~1000x slower than bf16
    (torch.float16, "cuda", torch.float16),
])
def test_auto_dtype_follows_the_checkpoint(checkpoint, device, expected):
    assert resolve_dtype("auto", checkpoint, torch.device(device)) == expected


def test_bfloat16_checkpoint_loads_as_bfloat16(make_checkpoint):
    llm = LLM(str(make_checkpoint("llama-tied", dtype=torch.bfloat16)))
    assert llm.engine.dtype == torch.bfloat16
    assert ModelConfig.from_dir(make_checkpoint("llama-tied", dtype=torch.bfloat16)).tie_word_embeddings
    assert len(llm.generate(PROMPT, GREEDY)[0].token_ids) == 12
