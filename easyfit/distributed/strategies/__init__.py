"""One module per backend, each a small Strategy subclass."""
