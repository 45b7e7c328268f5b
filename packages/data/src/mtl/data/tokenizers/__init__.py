"""Tokenizers behind one protocol (``base.Tokenizer``), one file per kind."""
