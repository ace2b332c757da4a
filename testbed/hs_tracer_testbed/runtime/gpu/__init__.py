"""GPU runtime for the hs_tracer testbed: what it takes to run real SGLang 0.5.23 (EAGLE-3, CUDA graphs,
overlap scheduler, TP > 1) on a CUDA machine whose torch is not the one SGLang's compiled wheels
were built for. Applied only through :mod:`.launcher`, never by the production plugin; importing this
package is cheap (no torch, no SGLang).

Pieces: an ``sgl_kernel`` stand-in (``pythonpath/sgl_kernel``, ops in :mod:`.ops`), fallback modules
for ``flash_mla`` and ``IPython.display`` (:mod:`.standin`), SGLang patches (:mod:`.patches`), and the
flags and environment that keep SGLang on paths that need no missing binary (:mod:`.launcher`).
docs/gpu.md says how to install and run it.
"""
