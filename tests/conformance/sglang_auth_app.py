"""Run by SGLang 0.5.23's python: SGLang's own authentication over HTTP, without a model.

SGLang's full server takes minutes to start on CPU, and its auth lives in two places that need
no model: the middleware and decision (``srt/utils/auth.py``, loaded here from its file, unchanged)
and the level each route is decorated with (``@auth_level(...)`` in ``srt/entrypoints``, read here
from the source). This serves every route SGLang declares, at its declared level, behind SGLang's
``add_api_key_middleware``; a request the middleware lets through gets 200 ``{"passed": true}``.

    python sglang_auth_app.py PORT API_KEY ADMIN_API_KEY   ("-" for none)
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import uvicorn
from fastapi import FastAPI

# found, not imported: importing sglang takes most of a minute here
SRT = Path(importlib.util.find_spec("sglang").submodule_search_locations[0]) / "srt"


def load_auth():
    spec = importlib.util.spec_from_file_location("sglang_auth", SRT / "utils" / "auth.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["sglang_auth"] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


def declared_routes() -> list[tuple[str, list[str], str | None]]:
    """(path, methods, level name or None) of every ``@app``/``@router`` route in srt/entrypoints."""
    out = []
    for file in sorted((SRT / "entrypoints").rglob("*.py")):
        tree = ast.parse(file.read_text())
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            level, paths = None, []
            for dec in node.decorator_list:
                if not isinstance(dec, ast.Call) or not isinstance(dec.func, ast.Attribute | ast.Name):
                    continue
                name = dec.func.attr if isinstance(dec.func, ast.Attribute) else dec.func.id
                if name == "auth_level" and dec.args and isinstance(dec.args[0], ast.Attribute):
                    level = dec.args[0].attr
                elif name in ("get", "post", "put", "delete", "api_route") and dec.args:
                    if not isinstance(dec.args[0], ast.Constant) or not isinstance(dec.args[0].value, str):
                        continue
                    methods = [name.upper()] if name != "api_route" else ["GET"]
                    for kw in dec.keywords:
                        if kw.arg == "methods":
                            methods = [e.value for e in kw.value.elts]
                    paths.append((dec.args[0].value, methods))
            out += [(p, m, level) for p, m in paths]
    return out


def main() -> None:
    port, api_key, admin_api_key = int(sys.argv[1]), *(None if a == "-" else a for a in sys.argv[2:4])
    auth = load_auth()
    app = FastAPI()
    for path, methods, level in declared_routes():

        async def passed() -> dict[str, bool]:
            return {"passed": True}

        if level is not None:
            passed = auth.auth_level(auth.AuthLevel[level])(passed)
        app.add_api_route(path, passed, methods=methods)
    auth.add_api_key_middleware(app, api_key=api_key, admin_api_key=admin_api_key)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main()
