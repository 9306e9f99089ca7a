"""The two built-in models as the text layer knows them: their names and shapes, where each one's checkpoint is
cached once written, and their tokenizer, trained deterministically (no torch), so that any host can tokenize
for them. Their weights are written by the engine (`gpu_worker/engine/builtin_models.py`).

They are real HF-format checkpoints (config.json, safetensors, tokenizer.json, chat template) with
random weights, for benchmarks and tests that need a fixed shape: their text is gibberish. The trained model
served by default is a packaged one (`packaged_models.py`); any HF directory or GGUF file serves by its path.
"""

from __future__ import annotations

import random
from pathlib import Path

from services.base.settings import cache_dir

FORMAT_VERSION = "v1"
VOCAB_SIZE = 32000
SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# name -> transformers' model type and config (the shape)
BUILTIN_MODELS = {
    # ~14 M parameters: fast enough for tests and a laptop.
    "tokenfleet-small": ("llama", dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8,
                                       num_key_value_heads=4, intermediate_size=768, tie_word_embeddings=True)),
    # ~125 M parameters: the benchmark model.
    "tokenfleet-large": ("llama", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                       num_key_value_heads=4, intermediate_size=2048, tie_word_embeddings=False)),
    # tokenfleet-small's shape with a sliding window of 256 tokens in every layer (Mistral's attention)
    "tokenfleet-sliding": ("mistral", dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8,
                                           num_key_value_heads=4, intermediate_size=768, tie_word_embeddings=True,
                                           sliding_window=256)),
    # tokenfleet-small's shape as a Gemma 3: five sliding layers (window 256) to one full one, a table each
    "tokenfleet-hybrid": ("gemma3_text", dict(hidden_size=256, num_hidden_layers=6, num_attention_heads=8,
                                              num_key_value_heads=4, head_dim=32, intermediate_size=768,
                                              tie_word_embeddings=True, sliding_window=256,
                                              layer_types=["sliding_attention"] * 5 + ["full_attention"])),
    # A Qwen3-MoE of ~0.5 B parameters, 32 experts of which each token runs 4: its active parameters are
    # tokenfleet-large's (4 experts of 512 = one MLP of 2048), the dense model to weigh its routing against.
    "tokenfleet-moe": ("qwen3_moe", dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                         num_key_value_heads=4, head_dim=64, intermediate_size=2048,
                                         num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
                                         norm_topk_prob=True, tie_word_embeddings=False)),
}

_COMMON_WORDS = (  # noqa: SIM905 - a word list reads best as text
    "the of and to in is you that it he was for on are as with his they I at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up other "
    "about out many then them these so some her would make like him into time has look two more write go see "
    "number no way could people my than first water been call who its now find long down day did get come made "
    "may part model token cache serve fast cost price request answer question enable disable"
).split()
_SYLLABLES = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"] + ["th", "sh", "ch", "ing", "er", "ly"]


def builtin_path(name: str) -> Path:
    """Where the model's checkpoint is, once written."""
    return cache_dir() / "models" / f"{name}-{FORMAT_VERSION}"


def is_built(name: str) -> bool:
    return (builtin_path(name) / "config.json").is_file()


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
