"""The README's error table against the code: every (status, code) the frontend can answer with
is in the table with that status, and the table names nothing the code does not produce.

The frontend's own refusals are read from its source (every `ApiError(status, message, code)`);
the image errors from their classes (413 for ImageTooLarge, 400 for the others, as
`frontend.request._image_error` maps them); a worker's error by whose fault it is (client: 400;
ours: 503 for the codes in `frontend.journey.UNAVAILABLE`, else 500)."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import mmhandoff.frontend.app as app
import mmhandoff.frontend.journey as journey
import mmhandoff.frontend.request as request
from mmhandoff.media import fetch, images

pytestmark = pytest.mark.unit

README = Path(__file__).resolve().parents[1] / "README.md"


def _table() -> dict[str, set[int]]:
    """{code: statuses} from the README's `| case | status | code |` table."""
    lines = README.read_text().splitlines()
    start = lines.index("| case | status | code |")
    out: dict[str, set[int]] = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        _, case, status, codes, _ = line.split("|")
        for code in re.findall(r"`([a-z0-9_]+)`", codes):
            out.setdefault(code, set()).add(int(status))
    return out


def _raised_by_the_frontend() -> set[tuple[int, str]]:
    found = set()
    for module in (app, journey, request):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "ApiError"
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[2], ast.Constant)):
                found.add((node.args[0].value, node.args[2].value))
    return found


def _image_errors() -> set[tuple[int, str]]:
    classes = [c for m in (images, fetch) for _, c in inspect.getmembers(m, inspect.isclass)
               if issubclass(c, images.ImageError) and c is not images.ImageError]
    return {(413 if issubclass(c, images.ImageTooLarge) else 400, c.code) for c in classes}


def test_every_refusal_at_the_edge_is_in_the_table_with_its_status():
    table = _table()
    expected = _raised_by_the_frontend() | _image_errors()
    assert len(expected) > 15  # the scan found the frontend's refusals
    missing = {(status, code) for status, code in expected if status not in table.get(code, ())}
    assert not missing, f"README's error table lacks {sorted(missing)}"


def test_the_tables_server_errors_are_what_the_frontend_maps_them_to():
    table = _table()
    for code in journey.UNAVAILABLE:
        assert table.get(code) == {503}, code
    from mmhandoff.plane.runtime import RemoteError
    for code, statuses in table.items():
        if 500 in statuses or 503 in statuses:
            assert {journey.api_error(RemoteError(code, "x")).status} == statuses, code
    assert journey.api_error(RemoteError("invalid_request", "x", fault="client")).status == 400


def test_a_request_over_the_planes_limit_is_the_clients_413(loop):
    """Dynamo refuses to send a message over NATS' max_payload: the caller gets a typed 413, not a
    retried 503 (the same request would fail the same way)."""
    from mmhandoff.plane.runtime import RemoteError, call

    class Refusing:  # a Dynamo client whose request plane refuses the message, as 1.6.1 says it
        async def round_robin(self, request, context=None):
            raise ValueError("InvalidRequest: Request payload is too large for this deployment. "
                             "Reduce the input size or metadata size and retry.")

    async def first():
        return [item async for item in call(Refusing(), {"big": "x"}, lost="prefill_failed")]

    with pytest.raises(RemoteError) as e:
        loop.run(first())
    assert (e.value.code, e.value.fault) == ("request_too_large", "client")
    assert journey.api_error(e.value).status == 413
    assert _table()["request_too_large"] == {413}


def test_the_table_names_only_codes_the_code_produces():
    source = "\n".join(p.read_text() for p in
                       (Path(app.__file__).parents[1]).rglob("*.py"))
    unknown = [code for code in _table() if f'"{code}"' not in source]
    assert not unknown, f"README's error table names codes nothing produces: {unknown}"
