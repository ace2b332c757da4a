"""The capture-metadata hook sits on every model body of the installed SGLang (0.5.23) that returns
the aux hidden states it captured: the table in hs_tracer.integrations.sglang.versions is checked
against the release's own model sources, and each entry against the real class.
"""

from __future__ import annotations

from pathlib import Path

from tests.test_plugin import WITH_STAND_IN, run_python


def _bodies_returning_aux_states(models_dir: Path) -> set[str]:
    """``module.Class`` of every class in SGLang's model sources that defines a ``forward`` returning a
    tuple with its captured aux hidden states (``aux_hidden_states``, ``aux_hidden_states.finalize()``)."""
    import ast

    def is_aux(e: ast.expr) -> bool:
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute):
            e = e.func.value
        return isinstance(e, ast.Name) and "aux_hidden" in e.id

    found = set()
    for path in sorted(models_dir.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward"):
                returns = [r.value for r in ast.walk(fn) if isinstance(r, ast.Return) and r.value is not None]
                tuples = [t for r in returns for t in ast.walk(r) if isinstance(t, ast.Tuple)]
                if any(any(map(is_aux, t.elts)) for t in tuples):
                    found.add(f"{path.stem}.{cls.name}")
    return found


def test_capture_metadata_hooks_cover_every_model_body_of_the_release() -> None:
    # Every target SGLang 0.5.23 can pair with an EAGLE-3 draft (Llama, Qwen2/3, DeepSeek, GLM, Gemma,
    # MiniMax, gpt-oss, ...) captures in such a body; the hook table must name each one, on the class
    # that defines the forward (a hook on an inherited forward would wrap the base class's twice).
    import importlib.util

    from hs_tracer.integrations.sglang import releases as sglang_releases
    from hs_tracer.integrations.sglang import versions

    family = versions.installed_family()
    assert family is sglang_releases.family_for("0.5.23")  # the older releases run their own test modules
    models = Path(importlib.util.find_spec("sglang.srt.models").submodule_search_locations[0])
    hooked = {h.target.removeprefix("sglang.srt.models.").removesuffix(".forward")
              for h in family.hooks if h.optional}
    assert hooked == _bodies_returning_aux_states(models)
    assert {"llama.LlamaModel", "qwen2.Qwen2Model", "qwen3.Qwen3Model", "deepseek_v2.DeepseekV2Model",
            "gpt_oss.GptOssModel", "glm4_moe.Glm4MoeModel"} <= hooked
    out = run_python(WITH_STAND_IN + """
    import pkgutil
    from hs_tracer.integrations.sglang import versions
    bodies = [h.target.rsplit(".", 1)[0] for h in versions.installed_family().hooks if h.optional]
    served = [b for b in bodies if versions.importable(b + ".forward")]
    for b in served:
        assert "forward" in vars(pkgutil.resolve_name(b)), b
    print("ok", len(served))
    """)
    assert out.startswith("ok ") and int(out.split()[1]) >= 30
