"""EAGLE-3 draft models in plain torch (SGLang's semantics), for training, simulation and replay."""
