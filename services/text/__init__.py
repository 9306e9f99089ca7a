"""The text layer, without torch: where a model's files are (built-in, packaged or a path), its tokenizer (HF or
GGUF) and chat template, a request's prompt ids (tokenized once on the way in), block hashes, and the errors
they raise."""
