"""The rids a request's pieces go under never prefix each other, so SGLang's prefix-matching /abort_request
(sglang/srt/managers/scheduler.py, Scheduler.abort_request: `req.rid.startswith(recv_req.rid)`) aborting one
piece can never reach another piece, of this request or of any other."""

from hypothesis import given, settings
from hypothesis import strategies as st

from async_rl.engine.sglang_api import piece_rid
from async_rl.types import new_id

rids = st.one_of(st.text(max_size=12), st.just(new_id()), st.sampled_from(["a", "a-m1", "a/1.", "1:a/0.", "ab", ""]))


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(rids, st.integers(0, 120)), min_size=2, max_size=6, unique=True))
def test_no_piece_rid_is_a_prefix_of_another(pieces):
    sent = [piece_rid(rid, k) for rid, k in pieces]
    assert len(set(sent)) == len(sent)
    for a in sent:
        for b in sent:
            assert a == b or not b.startswith(a), (a, b)


def test_the_old_names_were_prefixes():
    """What failover sent before: the request's rid for its first piece and "<rid>-m<k>" after a move, so
    aborting the first piece on a server also aborted the moved piece there (and "-m1" the piece "-m10")."""
    rid = new_id()
    assert f"{rid}-m1".startswith(rid) and f"{rid}-m10".startswith(f"{rid}-m1")
    assert not piece_rid(rid, 1).startswith(piece_rid(rid, 0)) and not piece_rid(rid, 10).startswith(piece_rid(rid, 1))
