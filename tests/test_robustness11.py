"""nb11 (session 11): a newcomer's path through the README and docs, then attacks on the newest
changes: mixed precision through LossScaleOptimizer around hgsgc.DistributedOptimizer, the tape's
nonfinite guard, the default Elias-Fano index coding (odd rank counts, tiny and empty tensors,
process sets). Each test either pins a fix (it failed before) or pins behaviour that held under
attack (said so in its docstring)."""
import pytest

from conftest import mpi_result

# ------------------------------------------------------------------ op names per process set (fix)
@pytest.mark.mpi
@pytest.mark.parametrize("np_", [2, 3, 4])
def test_collective_names_agree_when_one_rank_built_exchangers_on_another_process_set(np_):
    """Fixed: the last rank also trains on a process set of its own (an SGC-tree optimizer and a
    guarded tape), between two identical rounds of global exchanges (SGC tree and node, TernGrad,
    PowerSGD, an SGC tape with nonfinite="skip"). The op names carried a process-wide count of
    exchangers (``Exchanger._instances``: tree/node rounds, TernGrad's scale, PowerSGD's P/Q) and
    of checked tapes (the tape's finiteness verdict), so in the second round the last rank named
    its collectives differently from the others and the job hung (2 ranks: 'Missing ranks: 0:
    [hgsgc_tree_7_round0] 1: [hgsgc_tree_5_round0]', killed after 200 s; 3 ranks alike in
    brk11_ef.py's process sets). Now numbered per process set: the second round equals the first
    bit for bit, identical on every rank."""
    out = mpi_result(np_, ["tests/mpi/brk11_uid.py"], timeout=400)
    for r in out["ranks"]:
        assert set(r) == {"sgc_tree", "sgc_node", "terngrad", "powersgd", "tape"}, r
        for name, got in r.items():
            assert got == {"r2_equals_r1": True, "spread": 0.0}, (name, got)
