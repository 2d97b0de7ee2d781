"""The package's layers import one way: core <- runtime <- planner <- the public modules <- cli."""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).parent.parent / "osdp_jax"
# what each layer may not import
FORBIDDEN = {
    "core": ("osdp_jax.runtime", "osdp_jax.planner", "osdp_jax.cli"),
    "runtime": ("osdp_jax.planner", "osdp_jax.cli"),
    "planner": ("osdp_jax.cli",),
}


def _imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import (the package imports absolutely)"
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_layers_import_one_way():
    wrong = []
    for layer, forbidden in FORBIDDEN.items():
        for path in sorted((PACKAGE / layer).glob("*.py")):
            wrong += [f"{path.relative_to(PACKAGE)} imports {name}" for name in sorted(_imports(path))
                      if name.startswith(forbidden)]
    assert not wrong, wrong


def test_the_library_never_imports_the_cli():
    library = [p for p in PACKAGE.rglob("*.py") if "cli" not in p.relative_to(PACKAGE).parts]
    assert library and not [str(p) for p in library if any(n.startswith("osdp_jax.cli") for n in _imports(p))]
