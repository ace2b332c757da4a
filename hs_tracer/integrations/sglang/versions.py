"""The version guard: the installed SGLang checked against its release family before anything registers.

The families themselves (hooks, layer-id rules, draft layouts, releases) are data in
:mod:`hs_tracer.integrations.sglang.releases`, one adapter module per family. This module is what needs the
installed SGLang: which release is installed, whether every target, parameter and scheduler entry
of its family is there (and, for an untested release, every read and layer-id rule), and which
hooks can register in this process.

If anything is missing or its signature changed, the plugin logs one line naming it and stays off,
so an SGLang upgrade can never break serving through hs_tracer.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import pkgutil
import re
import sys

from hs_tracer import sources
from hs_tracer.integrations.sglang.releases import (
    FAMILIES,
    family_for,
    is_untested,
    rules_release,
    supported_text,
)
from hs_tracer.integrations.sglang.releases.adapter import MetaCounters, SGLangFamily
from hs_tracer.release_table import Hook, family_or_problem, handler_name, signature_problems


def hook_name(handler: str) -> str:
    """The name a handler (``module:function``) runs under: its hook's in the installed release's
    family, else in the first family that lists it."""
    return handler_name(handler, (installed_family(), *FAMILIES))


def hooks_here(family: SGLangFamily, worker: str | None = None) -> tuple[Hook, ...]:
    """The family's hooks that register in this process (the worker's, or every worker's): a model
    body whose module cannot be imported here is left out, as none of its models can be served."""
    hooks = family.hooks if worker is None else family.hooks_for(worker)
    return tuple(h for h in hooks if not h.optional or importable(h.target))


def importable(target: str) -> bool:
    """Whether a model body's hook target (``module.Class.method``) exists in this process: a module
    that needs a kernel this machine lacks does not import (and then none of its models can be served
    here either), and a release may not have every body of the table."""
    module, cls, method = target.rsplit(".", 2)
    try:
        return hasattr(getattr(importlib.import_module(module), cls), method)
    except Exception:  # whatever a model module raises at import, it cannot be served here
        return False


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_family() -> SGLangFamily | None:
    return family_for(installed_version())


def installed_meta_counters() -> MetaCounters:
    """The keys of the installed release's per-request speculative counters in ``meta_info`` (the
    newest family's where no supported release is installed)."""
    return (installed_family() or FAMILIES[0]).meta_counters


def problems(family: SGLangFamily | None = None, *, check_reads: bool | None = None) -> list[str]:
    """What is missing or changed in the installed SGLang, as short phrases (empty: supported).

    ``family`` overrides the family chosen by the installed version (tests check one family's targets
    against another release this way). ``check_reads`` (default: only for an untested release) also
    checks that every attribute the hooks read is still named in SGLang's source and that the
    DeepSeek and gpt-oss layer-id rules are still the family's.
    """
    version = installed_version()
    checked = family_or_problem("sglang", version, family or family_for(version), supported_text())
    if isinstance(checked, str):
        return [checked]
    family = checked
    if check_reads is None:
        check_reads = is_untested(version)
    # Outside a scheduler process the first import of SGLang's modules can stop inside one of its own
    # import cycles (one release's scheduler module, imported first): a second pass sees them imported.
    found = _missing(family) or _missing(family)
    if check_reads and not found:
        found += _changed_reads(family) + _changed_layer_id_rules()
    return found


_WORD_RE = re.compile(r"\b\w+\b")


def _changed_reads(family: SGLangFamily) -> list[str]:
    """Each attribute a hook reads must still be there. Where the read starts at a parameter (or the
    result) whose annotation names a class, its first attribute must be one of that class's fields or
    attributes; every other name must still occur in the target's module or, failing that, in an
    SGLang module imported so far (a rename removes the old name)."""
    package: set[str] | None = None
    found = []
    for hook in hooks_here(family):
        fn = pkgutil.resolve_name(hook.target)
        module = sys.modules.get(fn.__module__)
        try:
            words = set(_WORD_RE.findall(inspect.getsource(module))) if module else set()
        except (OSError, TypeError):
            words = set()
        for read in hook.reads:
            parts = read.split(".")
            rooted = parts[0] in (*hook.params, "result")
            names = parts[1:] if rooted else parts
            cls = _annotated_class(fn, parts[0]) if rooted else None
            if cls is not None and names:
                if not _has_attribute(cls, names[0]):
                    found.append(f"{hook.name} reads {read}, but {cls.__name__} has no {names[0]}")
                    continue
                names = names[1:]
            gone = [n for n in names if n not in words]
            if gone and package is None:
                package = _srt_words()
            gone = [n for n in gone if n not in (package or set())]
            if gone:
                found.append(f"{hook.name} reads {read}, but SGLang no longer names {', '.join(gone)}")
    return found


def _annotated_class(fn: object, name: str) -> type | None:
    """The class a parameter (``result``: the return value) of ``fn`` is annotated with, if any."""
    try:
        sig = inspect.signature(fn)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if name == "result":
        annotation = sig.return_annotation
    else:
        param = sig.parameters.get(name)
        annotation = param.annotation if param is not None else inspect.Signature.empty
    if isinstance(annotation, str):
        annotation = getattr(fn, "__globals__", {}).get(annotation.strip("'\""))
    return annotation if isinstance(annotation, type) else None


def _has_attribute(cls: type, name: str) -> bool:
    """A field (dataclass, msgspec struct, annotation), a class attribute, or an instance attribute
    the class's own source sets (``self.name``)."""
    fields = set(getattr(cls, "__struct_fields__", ()))  # msgspec structs
    for klass in cls.__mro__:
        fields.update(getattr(klass, "__annotations__", {}))
    if name in fields or hasattr(cls, name):
        return True
    try:
        return f"self.{name}" in inspect.getsource(cls)
    except (OSError, TypeError):
        return False


def _srt_words() -> set[str]:
    """The names in every SGLang module imported so far (the hook targets' and what they import)."""
    words: set[str] = set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None) if name.startswith("sglang.srt") else None
        if path and path.endswith(".py"):
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    words.update(_WORD_RE.findall(f.read()))
            except OSError:
                continue
    return words


# (module, class, layer-id family) whose set_eagle3_layers_to_capture changed between releases.
_RULE_CLASSES = (("sglang.srt.models.deepseek_v2", "DeepseekV3ForCausalLM", "deepseek"),
                 ("sglang.srt.models.gpt_oss", "GptOssForCausalLM", "gpt_oss"))
_RULE_CASES = ((61, (None, (1, 29, 57), (2, 30, 58), (0, 3, 31))), (36, ((24, 30, 36), (1, 17, 33))))


def _changed_layer_id_rules() -> list[str]:
    """Run the installed release's own ``set_eagle3_layers_to_capture`` (on a stand-in ``self``; no
    weights) and compare with the rule hs_tracer applies to it (``releases.rules_release``)."""
    from types import SimpleNamespace

    release = rules_release(installed_version())
    found = []
    for module, name, family in _RULE_CLASSES:
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            found.append(f"{module}.{name} is missing ({type(exc).__name__})")
            continue
        for n, cases in _RULE_CASES:
            for ids in cases:
                inner = SimpleNamespace(layers_to_capture=[])
                inner.set_eagle3_layers_to_capture = lambda got, inner=inner: setattr(
                    inner, "layers_to_capture", list(got))
                fake = SimpleNamespace(pp_group=SimpleNamespace(is_last_rank=True),
                                       config=SimpleNamespace(num_hidden_layers=n), model=inner,
                                       capture_aux_hidden_states=False)
                want = sources.sglang_layers_to_capture(list(ids) if ids else None, sources.Family(family), n,
                                                        engine_version=release)
                try:
                    cls.set_eagle3_layers_to_capture(fake, list(ids) if ids else None)
                    got = list(inner.layers_to_capture)
                except Exception as exc:  # any failure means the rule changed
                    got = f"{type(exc).__name__}"
                if got != want:
                    found.append(f"{name}.set_eagle3_layers_to_capture({list(ids) if ids else None}) with "
                                 f"{n} layers gives {got}, {release}'s rule {want}")
    return found


def _missing(family: SGLangFamily) -> list[str]:
    """The family's scheduler entry, targets and parameters that the installed SGLang lacks."""
    found: list[str] = []
    module, function = family.scheduler_entry
    try:
        pkgutil.resolve_name(f"{module}:{function}")
    except (ImportError, AttributeError) as exc:
        found.append(f"the scheduler process entry {module}.{function} is missing ({type(exc).__name__}): "
                     "SGLang starts schedulers elsewhere now")
    found += signature_problems(family.hooks, {h.target for h in hooks_here(family)})
    return found
