"""The two built-in checkpoints, made deterministically on first use and cached on disk.

They are real HF-format Llama checkpoints (config.json, safetensors, tokenizer.json, chat template) with
random weights, for benchmarks and tests that need a fixed shape: their text is gibberish. The trained model
served by default is a packaged one (`packaged_models.py`); any HF directory or GGUF file serves by its path.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

FORMAT_VERSION = "v1"
VOCAB_SIZE = 32000
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

BUILTIN_MODELS = {
    # ~14 M parameters: fast enough for tests and a laptop.
    "tokenfleet-small": dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                             intermediate_size=768, tie_word_embeddings=True),
    # ~125 M parameters: the benchmark model.
    "tokenfleet-large": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                             num_key_value_heads=4, intermediate_size=2048, tie_word_embeddings=False),
}

_COMMON_WORDS = (  # noqa: SIM905 - a word list reads best as text
    "the of and to in is you that it he was for on are as with his they I at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up other "
    "about out many then them these so some her would make like him into time has look two more write go see "
    "number no way could people my than first water been call who its now find long down day did get come made "
    "may part model token cache serve fast cost price request answer question enable disable"
).split()
_SYLLABLES = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"] + ["th", "sh", "ch", "ing", "er", "ly"]


def cache_dir() -> Path:
    return Path(os.environ.get("TOKENFLEET_CACHE_DIR", Path.home() / ".cache" / "tokenfleet"))


def _target(name: str) -> Path:
    return cache_dir() / "models" / f"{name}-{FORMAT_VERSION}"


def is_built(name: str) -> bool:
    return (_target(name) / "config.json").is_file()


def ensure_builtin(name: str) -> Path:
    target = _target(name)
    if is_built(name):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        _build(name, staging)
        try:
            staging.rename(target)  # atomic: concurrent builders race, one wins, the others discard
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def training_corpus(lines: int = 30000, seed: int = 0):
    rng = random.Random(seed)
    for _ in range(lines):
        words = [
            rng.choice(_COMMON_WORDS) if rng.random() < 0.55
            else "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(4, 18))
        ]
        if rng.random() < 0.2:
            words.append(str(rng.randint(0, 10000)))
        yield " ".join(words).capitalize() + rng.choice(".?!,;:")


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|im_end|>",
        pad_token="<|end_of_text|>", chat_template=CHAT_TEMPLATE,
    )


def _build(name: str, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    special = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, max_position_embeddings=2048, rms_norm_eps=1e-5,
        bos_token_id=special[0], eos_token_id=[special[3], special[1]], pad_token_id=special[1],
        **BUILTIN_MODELS[name],
    )
    torch.manual_seed(sum(map(ord, name)))
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
