"""Model families of the torch backend."""
