"""An independent reference for the Hourglass step (tests only): the GPipe schedule of
hgsgc.hourglass.step as its longest path, one rank per machine (no CPU shared), written as the
recursion over micro-batches, with the stages derived from the fused per-example times as
docs/hourglass.md states (backward = ``ratio`` x forward, no per-call cost) or given."""
import numpy as np


def rows_of(b, M):
    """Rows of the M micro-batches (linspace(0, b, M + 1) rounded down, as micro_batch_bounds)."""
    e = np.linspace(0, b, M + 1).astype(int)
    return [int(hi - lo) for lo, hi in zip(e[:-1], e[1:])]


def derived_stages(b, M, t_conv, t_fc, ratio=2.0):
    """(conv_fwd_mb_s, conv_bwd_mb_s, fc_call_s, fc_row_s) derived from t_conv, t_fc by hand."""
    per = b * t_conv / M
    return per / (1 + ratio), per * ratio / (1 + ratio), 0.0, t_fc


def gpipe_step(b, M, m, stages, codec_s, alpha, beta, act, grad, conv_post=(0.0, 0.0), fc_post=(0.0, 0.0)):
    """Step seconds and the end of the last backward: forwards f_j in series, link in i_j after
    f_j, head h_j after i_j, link out o_j after h_j, backwards g_j after the forwards and o_j;
    each resource runs its tasks in order; then each role's post-work (CPU, then wait)."""
    fwd, bwd, call, row = stages
    rs = rows_of(b, M)
    f = [fwd * r * M / b + r * codec_s / 4 for r in rs]
    g = [bwd * r * M / b + r * codec_s / 4 for r in rs]
    i = [alpha + m * r * act / beta for r in rs]
    h = [call + m * r * (row + codec_s / 2) for r in rs]
    o = [alpha + m * r * grad / beta for r in rs]
    F = np.cumsum(f)
    I = H = O = 0.0
    Ij, Hj, Oj = [], [], []
    for j in range(M):
        I = max(I, F[j]) + i[j]
        H = max(H, I) + h[j]
        O = max(O, H) + o[j]
        Ij.append(I), Hj.append(H), Oj.append(O)
    G = F[-1]
    for j in range(M):
        G = max(G, Oj[j]) + g[j]
    step = max(G + sum(conv_post), Hj[-1] + sum(fc_post))
    return step, G
