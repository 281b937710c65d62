"""Routes into other libraries' ways of building an optimizer: transformers' Trainer (:mod:`.hf`) and
recipe files in the ``_component_`` style (:mod:`.recipe`). A layer above :mod:`offload_adamw.optim`;
the libraries themselves are imported only when a route is used."""
