"""specdec gateway: the public Generate/Complete API, tokenizer front end, routing over verifiers (see README.md)."""
