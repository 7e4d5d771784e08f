from tests.apps import build_app
from tests.helpers import client, effects, headers, new_key


async def test_new_then_replay(schema, db, tenant):
    app = build_app(schema)
    key = new_key()
    async with client(app) as http:
        first = await http.post("/tx/charge", json={"a": 1}, headers=headers(tenant, key))
        second = await http.post("/tx/charge", json={"a": 1}, headers=headers(tenant, key))
    assert first.status_code == 201, first.text
    assert second.status_code == 201
    assert second.content == first.content
    assert second.headers["idempotent-replayed"] == "true"
    assert await effects(db, tenant) == 1
