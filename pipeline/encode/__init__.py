"""Encode: tokenizers, example kinds, chat templates, rows to tokenized examples, bad rows."""
