"""The documentation's code runs as written, and the API reference covers the public names.

Each page's ``python`` blocks run in order in one namespace (a page is one program), on the 8
simulated devices; a block whose first line is ``# not run`` is shown only."""
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"


def blocks(text: str) -> list[str]:
    return [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if not b.startswith("# not run")]


PAGES = sorted(p for p in DOCS.rglob("*.md") if blocks(p.read_text()))


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_runs_as_written(page):
    scope: dict = {"__name__": "__docs__"}
    for i, block in enumerate(blocks(page.read_text())):
        exec(compile(block, f"{page.relative_to(ROOT)} block {i}", "exec"), scope)


# every module whose names the API reference documents, and the page that documents them
API_MODULES = {
    "osdp_jax": "api/osdp_jax.md",
    **{f"osdp_jax.{m}": "api/submodules.md"
       for m in ("hardware", "layers", "planning", "search", "split", "strategies", "units", "xla")},
}


@pytest.mark.parametrize("module", sorted(API_MODULES))
def test_api_reference_covers_every_exported_name(module):
    """As optax's docs check: each name in a public module's ``__all__`` is documented on its API
    page (``::: module.name``, or the module itself with its members)."""
    mod = importlib.import_module(module)
    page = (DOCS / API_MODULES[module]).read_text()
    documented = set(re.findall(r"^::: ([\w.]+)", page, flags=re.M))
    missing = [name for name in mod.__all__
               if f"{module}.{name}" not in documented and not isinstance(getattr(mod, name), type(mod))]
    assert not missing, f"{API_MODULES[module]} does not document {module}: {missing}"


@pytest.mark.parametrize("module", sorted(API_MODULES))
def test_public_callables_that_take_arguments_document_them(module):
    """No public class or function that takes arguments has a one-line docstring."""
    import inspect
    mod = importlib.import_module(module)
    short = []
    for name in mod.__all__:
        obj = getattr(mod, name)
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue
        try:
            takes = [p for p in inspect.signature(obj).parameters if p != "self"]
        except (TypeError, ValueError):
            takes = ["?"]
        lines = [line for line in (inspect.getdoc(obj) or "").splitlines() if line.strip()]
        if takes and len(lines) < 2:
            short.append(name)
    assert not short, f"{module}: one-line docstrings on {short}"
