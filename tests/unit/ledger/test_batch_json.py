"""The ledger's batches as JSON text (gateway/ledger/postgres.py writes them with the
ledger's ``dumps``)."""
import json

from gateway.ledger.postgres import dumps


def test_a_batch_reads_back_as_the_records_it_was_made_of():
    records = [{"gid": "gen-1", "org": 7, "stream": False, "ttl": 60.0, "model": "modèle ✓",
                "error": None, "cost": 2 ** 63 - 1}]
    assert json.loads(dumps(records)) == records


def test_what_orjson_refuses_is_written_by_the_standard_library():
    # Past 64 bits (a count the database will refuse, so that the batch is split) and a lone
    # surrogate: both still reach Postgres as JSON text, not as an encoder's exception.
    records = [{"gid": "gen-2", "cost": 2 ** 70}, {"gid": "gen-3", "error": "\ud800"}]
    assert json.loads(dumps(records)) == records
