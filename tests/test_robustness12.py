"""brk12 (session 12): attacks on what sessions 11 and 12 built, as a hostile but realistic
Horovod / Slurm user. Each test either pins a fix (it failed before: said so in its docstring)
or pins behaviour that held under attack."""
import pytest

from conftest import mpi_result


# ------------------------------------------------------------------ node hierarchy env (fix)
@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3, 4])
def test_ranks_per_node_variable_on_some_ranks_only_is_one_error_not_a_hang(np_):
    """Fixed: ``$HGSGC_RANKS_PER_NODE`` set on the last rank only (``mpirun`` without ``-x``
    does not pass it to ranks on other hosts) made that rank skip the MPI host discovery the
    others entered, so SGC ``hierarchy="node"`` hung (2 ranks: 'Missing ranks: 0:
    [hgsgc_node_0_round0]', killed at 240 s). Now the exchanger agrees on the variable first:
    set on some ranks only or to different values, every rank raises the same ValueError naming
    it, the ranks and ``-x``; unset or equal everywhere, training runs and the weights are
    identical on every rank (and the job goes on after a refused case)."""
    out = mpi_result(np_, ["tests/mpi/check_robustness12_nodes.py"], timeout=400)
    recs = out["ranks"]
    for case in ("unset", "same", "after"):
        for r in recs:
            assert "error" not in r[case], (case, r["rank"], r[case])
            assert r[case]["w"] == recs[0][case]["w"], (case, r["rank"])
    assert recs[0]["same"]["hosts"] == [[i] for i in range(np_)]  # 1 rank per node
    assert recs[0]["unset"]["hosts"] == [list(range(np_))]  # one machine: one host
    assert recs[0]["after"] == recs[0]["unset"]
    for case, want in (("missing", "unset on ranks" if np_ > 2 else "unset on rank 0"),
                       ("differs", "'1' on rank 0")):
        msgs = {r[case].get("error") for r in recs}
        assert len(msgs) == 1, (case, msgs)  # the same error on every rank
        msg = msgs.pop()
        assert msg and msg.startswith("ValueError: hierarchy='node': $HGSGC_RANKS_PER_NODE differs"), msg
        assert want in msg and "-x HGSGC_RANKS_PER_NODE" in msg, msg
