"""Per-step fingerprints of the draft's input features: definition and merge (``stats``), torch
reference (``reference``), fused Triton kernel (``kernel``), the no-sync probe the hooks call
(``probe``) and float64 checks (``verify``). See docs/fingerprint.md. Submodules import torch; this
package module imports nothing."""
