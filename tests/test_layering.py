"""specserve's layers, read from the source: every import statement of every module, those inside
functions included, against the rules below. A failure names the module, the line and the
import. (pyproject.toml states the same rules as import-linter contracts.)"""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specserve"
COMMANDS = ("specserve.cli", "specserve.bench", "specserve.llm", "specserve.engine_args", "specserve.config_file")

# (what the rule says, the modules it binds, what they may not import)
RULES = {
    "lower layers": ("the model, sampling, proposers, draft types and KV bookkeeping sit below the engine, the "
                     "server and the commands",
                     ("specserve.model", "specserve.sample", "specserve.spec", "specserve.drafts", "specserve.kv"),
                     ("specserve.engine", "specserve.server", *COMMANDS)),
    "engine": ("the engine sits below the server and the commands",
               ("specserve.engine",), ("specserve.server", *COMMANDS)),
    "siblings": ("sampling and the proposers are siblings; the types they share live in specserve/drafts/",
                 ("specserve.sample",), ("specserve.spec",)),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The modules an import statement names (`from specserve import x` names specserve.x,
    which may be a module)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:  # relative: from the module's package, one level up per extra dot
        package = module.split(".")[: len(module.split(".")) - node.level + is_package]
        base = ".".join(package + ([node.module] if node.module else []))
    else:
        base = node.module
    return [f"{base}.{a.name}" for a in node.names] if base == "specserve" else [base]


def imports() -> list[tuple[str, int, str]]:
    """(module, line, imported module) for every specserve import in the package."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            for name in imported(node, module, path.name == "__init__.py"):
                if name.startswith("specserve"):
                    out.append((module, node.lineno, name))
    return out


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_reader_sees_imports_inside_functions():
    found = imports()
    assert any(m == "specserve.cli" and name == "specserve.bench.cli" for m, _, name in found)  # in build_parser
    assert any(m == "specserve.model.loader" and name == "specserve.native" for m, _, name in found)
    assert len({m for m, _, _ in found}) > 50


@pytest.mark.parametrize("rule", list(RULES))
def test_layers(rule):
    says, sources, forbidden = RULES[rule]
    bad = sorted({f"{m}:{line} imports {name}" for m, line, name in imports()
                  if within(m, sources) and within(name, forbidden)})
    assert not bad, f"{says}; but:\n" + "\n".join(bad)


@pytest.mark.skipif(shutil.which("lint-imports", path=str(Path(sys.executable).parent)) is None,
                    reason="import-linter is not installed (pip install -e '.[test]')")
def test_import_linter_contracts_hold():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    r = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
