"""EAGLE-3 draft models in plain torch (SGLang 0.5.23 semantics), for training, simulation and replay."""
