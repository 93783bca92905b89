"""The route report's perplexity and KL(teacher || model) equal a direct full-logits computation."""
import math

import torch
import torch.nn.functional as F

from test_upcycle_init_mamba import tiny_llama, tiny_student


def test_score_matches_direct_perplexity_and_kl():
    from upcycle.route_report import score
    teacher = tiny_llama(layers=2).float()
    student = tiny_student(teacher, ["mamba2", "mla"]).float()
    g = torch.Generator().manual_seed(0)
    windows = [torch.randint(3, 128, (17,), generator=g) for _ in range(5)]   # 5 windows: a partial last batch
    got = score(student, teacher, windows, batch_size=2)

    ids = torch.stack(windows)
    with torch.no_grad():
        log_ps = F.log_softmax(student(input_ids=ids[:, :-1]).logits.double(), -1)
        log_pt = F.log_softmax(teacher(input_ids=ids[:, :-1]).logits.double(), -1)
    nll = -log_ps.gather(-1, ids[:, 1:].unsqueeze(-1)).mean().item()
    kl = (log_pt.exp() * (log_pt - log_ps)).sum(-1).mean().item()
    assert got["tokens"] == 5 * 16
    assert abs(got["nll"] - nll) < 1e-4 and abs(got["ppl"] - math.exp(nll)) < 1e-3 * math.exp(nll)
    assert abs(got["kl"] - kl) < 1e-4 and kl > 0.01
    # the teacher against itself: KL 0, its own perplexity
    own = score(teacher, teacher, windows, batch_size=2)
    t_nll = -log_pt.gather(-1, ids[:, 1:].unsqueeze(-1)).mean().item()
    assert abs(own["kl"]) < 1e-5 and abs(own["nll"] - t_nll) < 1e-4
