"""What ``hacrl compare`` runs: the suites, their settings, contenders and claims.

A contender is a list of Hydra overrides applied after its setting's ``base`` (``{n_agents}`` in
an override is the pool's agent count). Each setting declares, before anything runs, its
**primary contrast** (two contenders and the endpoint: ``auc``, the mean held-out accuracy over
the rollouts every contender reached, or ``final``, the accuracy after the last iteration; both
on the mean over the agents), the at most six curves its main plot draws, and the secondary
claims it checks (Holm-corrected as one family; see :mod:`hacrl.study.claims`).
"""

from __future__ import annotations

HACPO_ABLATIONS = {
    "hacpo-adv": ["algorithm.advantage.capability_aware=false"],
    "hacpo-omega": ["algorithm.loss.discrepancy_coef=false"],
    "hacpo-expIS": ["algorithm.loss.alpha=0"],
    "hacpo-clip": ["algorithm.loss.cross_clip=false"],
    "hacpo-stepwise": ["algorithm.loss.cross_clip_delta_step=0"],
}

HACPO_CONTENDERS = {
    "grpo": ["algorithm=grpo"],
    "gspo": ["algorithm=gspo"],
    "gspo_x2": ["algorithm=gspo_x2"],
    "naive_share": ["algorithm=naive_share"],
    "hacpo": ["algorithm=hacpo"],  # the reference trainer's layout, EOS and ratio
    # the control that isolates learning from peers: HACPO's mini-batches, updates, lr schedule and
    # pooled baseline, the cross samples' terms weighted 0
    "hacpo_cw0": ["algorithm=hacpo", "algorithm.loss.cross_weight=0"],
    # the control that keeps the size of sharing's step and removes its direction: each update's
    # gradient from peers' samples replaced by a step of the same norm along the own samples'
    "hacpo_normmatch": ["algorithm=hacpo", "algorithm.norm_match=true"],
    # the equal-rollout baseline of an n-agent pool: n x G samples per prompt for each agent alone,
    # in GSPO's mini-batches of whole prompt groups (GSPO's update count; a source_blocks cut of
    # 3 x 8 samples does not divide HACPO's 512-sample mini-batches; gspo_3passes is the
    # update-count control)
    "gspo_xn": ["algorithm=gspo_x2", "algorithm.sample_multiplier={n_agents}", "algorithm.name=gspo_x{n_agents}",
                "algorithm.minibatch_order=prompt_groups"],
    "hacpo_learner_tokens": ["algorithm=hacpo", "algorithm.loss.cross_ratio_unit=learner_tokens"],
    # one change of the reference set-up each: what moved the result
    "hacpo_self_first": ["algorithm=hacpo", "algorithm.minibatch_order=self_first"],
    "hacpo_keep_eos": ["algorithm=hacpo", "algorithm.thl.peer_eos=keep_if_stopped"],
    **{k: ["algorithm=hacpo", *v] for k, v in HACPO_ABLATIONS.items()},
    # step-size probes (run on demand with --contenders, added to a setting's report): HACPO takes
    # n times GSPO's optimizer updates per step; do more updates alone, on the learner's own
    # samples, cost GSPO what HACPO loses, and does a smaller step close the gap?
    "gspo_3passes": ["algorithm=gspo", "trainer.epochs=3"],
    "gspo_lr3e4": ["algorithm=gspo", "trainer.lr=3e-4"],
    "hacpo_lr3e4": ["algorithm=hacpo", "trainer.lr=3e-4"],
    "gspo_lr1e4": ["algorithm=gspo", "trainer.lr=1e-4"],
    "hacpo_lr1e4": ["algorithm=hacpo", "trainer.lr=1e-4"],
    "gspo_x2_lr1e4": ["algorithm=gspo_x2", "trainer.lr=1e-4"],
    "gspo_3passes_lr1e4": ["algorithm=gspo", "trainer.epochs=3", "trainer.lr=1e-4"],
}
CORE = ["gspo", "gspo_x2", "gspo_xn", "naive_share", "hacpo", "hacpo_cw0", "hacpo_learner_tokens"]
HACPO_DEFAULT = [*CORE, "grpo", "hacpo_self_first", "hacpo_keep_eos", *HACPO_ABLATIONS]
"""The default setting's contenders; the lr and pass-count probes run on demand (``--contenders``);
``--tune trainer.lr=...`` chooses every contender's lr on dev instead."""

HACPO_TUNED_AS = {c: "hacpo" for c in ["hacpo_learner_tokens", "hacpo_self_first", "hacpo_keep_eos", "hacpo_normmatch",
                                      *HACPO_ABLATIONS]}
"""With ``--tune``, the variants that change one mechanism of HACPO take HACPO's chosen setting (an
ablation at another lr would change two things); the baselines and HACPO's primary control
(cross_weight 0) are swept on their own, the stricter test for HACPO."""

# the paper's step shape (128 prompts, 8 samples per agent, mini-batches of 64 prompts) and the
# reference runs' KL (0.001, k3, on self samples) for every contender alike
HACPO_STEP = ["rollout.prompts_per_iteration=128", "trainer.mini_batch_prompts=64", "algorithm.kl_coef=0.001"]

BEFORE_CLAMP = ["algorithm.kl_clamp=null"]
"""The settings whose runs were kept before the KL term was clamped (``algorithm.kl_clamp``) keep
it off: their kept runs are then theirs (``hacrl compare --resume`` reuses them), and their
reports compare like with like. A new setting runs with the clamp."""


# the claims checked per agent: (text, better contender, worse contender); a 4th element names the
# kind (see :func:`findings`), default ``final``
HACPO_CLAIMS = [
    ("HACPO above its control without learning from peers (cross_weight 0)", "hacpo", "hacpo_cw0"),
    ("HACPO above its norm-matched control (the peers' step size along the own gradient)", "hacpo", "hacpo_normmatch"),
    ("the norm-matched control above the cross_weight-0 control (a larger step alone)", "hacpo_normmatch", "hacpo_cw0"),
    ("HACPO above GSPO x n (n agents' rollouts for one agent alone)", "hacpo", "gspo_xn"),
    ("HACPO's control (cross_weight 0) above GSPO", "hacpo_cw0", "gspo"),
    ("HACPO above GSPO x2", "hacpo", "gspo_x2"),
    ("GSPO x2 above GSPO", "gspo_x2", "gspo"),
    ("HACPO above GSPO", "hacpo", "gspo"),
    ("naive sharing below GSPO", "gspo", "naive_share"),
    ("HACPO above naive sharing", "hacpo", "naive_share"),
    ("HACPO above GRPO", "hacpo", "grpo"),
    ("ratio over learner tokens above the reference ratio", "hacpo_learner_tokens", "hacpo"),
    ("reference layout above the mixed self_first layout", "hacpo", "hacpo_self_first"),
    ("dropping the peer's terminal EOS above keeping it", "hacpo", "hacpo_keep_eos"),
    *[(f"ablation {k.replace('hacpo', '')} costs accuracy", "hacpo", k) for k in HACPO_ABLATIONS],
    ("GSPO with three passes (HACPO's update count, own samples only) above one pass", "gspo_3passes", "gspo"),
    ("HACPO above GSPO, both at lr 3e-4", "hacpo_lr3e4", "gspo_lr3e4"),
    ("GSPO at lr 3e-4 above lr 5e-4", "gspo_lr3e4", "gspo"),
    ("HACPO at lr 3e-4 above lr 5e-4", "hacpo_lr3e4", "hacpo"),
    ("HACPO above GSPO, both at lr 1e-4", "hacpo_lr1e4", "gspo_lr1e4"),
    ("HACPO above GSPO x2, both at lr 1e-4", "hacpo_lr1e4", "gspo_x2_lr1e4"),
    ("GSPO x2 above GSPO, both at lr 1e-4", "gspo_x2_lr1e4", "gspo_lr1e4"),
    ("HACPO above GSPO with three passes (the same update count), both at lr 1e-4", "hacpo_lr1e4",
     "gspo_3passes_lr1e4"),
]

MUTUAL_CONTENDERS = {
    "grpo": ["algorithm=grpo"],
    "prp": ["algorithm=prp"],  # the learner's snapshot as the peer samples' denominator
    "prp_thl": ["algorithm=prp", "algorithm.loss.peer_denominator=thl_aligned_peer"],
    "xgrpo": ["algorithm=xgrpo"],
    "sgt": ["algorithm=sgt"],
    # SGT's control: the same row filter and layout with the NLL weight 0, so GRPO plus nothing --
    # is SGT's gain the injected answers?
    "sgt_nll0": ["algorithm=sgt", "algorithm.loss.nll_weight=0"],
    # SGT's oracle: the same gate, the gold completion injected instead of the peer's text
    "sgt_oracle": ["algorithm=sgt_oracle"],
    # step-size probes (run on demand with --contenders): HACPO's ordering appeared only at lr 1e-4
    "grpo_lr1e4": ["algorithm=grpo", "trainer.lr=1e-4"],
    "prp_lr1e4": ["algorithm=prp", "trainer.lr=1e-4"],
    "prp_thl_lr1e4": ["algorithm=prp", "algorithm.loss.peer_denominator=thl_aligned_peer", "trainer.lr=1e-4"],
    "sgt_lr1e4": ["algorithm=sgt", "trainer.lr=1e-4"],
}
MUTUAL_CORE = ["grpo", "prp", "prp_thl", "xgrpo", "sgt", "sgt_nll0", "sgt_oracle"]

MUTUAL_CLAIMS = [
    ("SGT above GRPO on the mean over agents", "sgt", "grpo", "average"),
    ("SGT above XGRPO on the mean over agents", "sgt", "xgrpo", "average"),
    ("SGT above PRP on the mean over agents", "sgt", "prp", "average"),
    ("SGT above PRP (THL-aligned) on the mean over agents", "sgt", "prp_thl", "average"),
    ("SGT at or above GRPO at every checkpoint", "sgt", "grpo", "every_checkpoint"),
    ("SGT above GRPO", "sgt", "grpo"),
    ("XGRPO equivalent to GRPO within the margin", "xgrpo", "grpo", "equal"),
    ("PRP below GRPO (the weaker agent hurt)", "grpo", "prp"),
    ("PRP lowers the policy entropy (GRPO above PRP)", "grpo", "prp", "entropy"),
    ("PRP raises the KL to the initial model", "prp", "grpo", "kl"),
    ("PRP (THL-aligned) below GRPO", "grpo", "prp_thl"),
    ("PRP (THL-aligned) lowers the entropy (GRPO above it)", "grpo", "prp_thl", "entropy"),
    ("PRP (THL-aligned) raises the KL to the initial model", "prp_thl", "grpo", "kl"),
    ("THL-aligned PRP above snapshot PRP", "prp_thl", "prp"),
    ("THL-aligned PRP keeps more entropy than snapshot PRP", "prp_thl", "prp", "entropy"),
    ("THL-aligned PRP drifts less (KL) than snapshot PRP", "prp", "prp_thl", "kl"),
    ("SGT above its control with lambda 0 (the injected answers carry the gain)", "sgt", "sgt_nll0"),
    ("SGT's oracle (the gold completion injected) above GRPO on the mean over agents", "sgt_oracle", "grpo", "average"),
    ("SGT (a peer's text) above its oracle (the gold completion) on the mean over agents", "sgt", "sgt_oracle", "average"),
    ("SGT equivalent to its oracle within the margin, on the mean over agents", "sgt", "sgt_oracle", "equal_average"),
    ("SGT with lambda 0 equivalent to GRPO within the margin", "sgt_nll0", "grpo", "equal"),
    ("SGT above GRPO on the mean over agents, both at lr 1e-4", "sgt_lr1e4", "grpo_lr1e4", "average"),
    ("SGT above GRPO, both at lr 1e-4", "sgt_lr1e4", "grpo_lr1e4"),
    ("PRP below GRPO, both at lr 1e-4", "grpo_lr1e4", "prp_lr1e4"),
    ("PRP (THL-aligned) below GRPO, both at lr 1e-4", "grpo_lr1e4", "prp_thl_lr1e4"),
    ("PRP raises the KL to the initial model, both at lr 1e-4", "prp_lr1e4", "grpo_lr1e4", "kl"),
    ("PRP at lr 1e-4 above PRP at lr 5e-4", "prp_lr1e4", "prp"),
]

MUTUAL_TUNED_AS = {"sgt_nll0": "sgt", "sgt_oracle": "sgt", "prp_thl": "prp"}
"""With ``--tune``: SGT's two controls (lambda 0; the gold completion injected) change only what is
injected and take SGT's chosen setting; THL-aligned PRP changes only PRP's denominator."""

# Mutual RL's step: GRPO's embedded settings at the HACPO suite's step size (128 prompts, 8 samples
# per agent, mini-batches of 64 prompts), no KL term, the KL to the initial model measured
MUTUAL_STEP = ["rollout.prompts_per_iteration=128", "trainer.mini_batch_prompts=64",
               "trainer.measure_kl_to_init=true"]

HACPO_GATE = {"window": "hacpo_first", "min_share": 0.3, "edges": None, "prompts": 32}
"""What HACPO's primary contrast needs of a pool (measured at iteration 0 before any run): at least
30 % of every edge's cross samples inside the cross window of the first update that holds them.
Below that, HACPO and its control train on the same gradient and the contrast measures nothing
(the pretrained pair: 0 % on both edges, every cross sample clipped)."""

HACPO_PRIMARY = {"text": "HACPO above its control without learning from peers (cross_weight 0)",
                 "better": "hacpo", "worse": "hacpo_cw0", "endpoint": "auc"}
"""HACPO's question here: do the cross samples teach the learner anything, beyond what the same
mini-batches, updates and baseline do without them?"""
HACPO_PLOT = ["hacpo", "hacpo_cw0", "gspo", "gspo_xn", "gspo_x2", "naive_share"]
MUTUAL_PRIMARY = {"text": "SGT above GRPO", "better": "sgt", "worse": "grpo", "endpoint": "auc"}
MUTUAL_PLOT = ["grpo", "sgt", "sgt_oracle", "prp", "prp_thl", "xgrpo"]


SUITES: dict[str, dict] = {
    "hacpo": {
        "settings": {
            "default": {"about": "the embedded pool (three tokenizers), boxed answers",
                        "base": [*HACPO_STEP, "experiment.iterations=6", *BEFORE_CLAMP],
                        "primary": HACPO_PRIMARY, "plot": HACPO_PLOT, "gate": HACPO_GATE,
                        "contenders": HACPO_DEFAULT},
            "shared_tok": {"about": "two agents sharing one tokenizer at two sizes (agents=embedded_shared_tok)",
                           "base": [*HACPO_STEP, "experiment.iterations=6", "agents=embedded_shared_tok",
                                    *BEFORE_CLAMP],
                           "primary": HACPO_PRIMARY, "plot": HACPO_PLOT, "gate": HACPO_GATE,
                           # one tokenizer: the two ratio units coincide (hacpo_learner_tokens is
                           # hacpo bit for bit, reports/hacpo/ANALYSIS.md), so it is not run
                           "contenders": [c for c in CORE if c != "hacpo_learner_tokens"]},
            "pretrained": {"about": "the pretrained pair: SmolLM2-135M-Instruct and Gemma-3-270M base, two families "
                                    "and tokenizers (agents=pretrained_pair experiment=pretrained_pair)",
                           "base": ["agents=pretrained_pair", "experiment=pretrained_pair", "experiment.iterations=4",
                                    # the dev split holds 35 distinct problems at max_operand 20
                                    # (heldout_fraction / 4 of about 670)
                                    "data.dev_size=32", "algorithm.kl_coef=0.001", *BEFORE_CLAMP],
                           "primary": HACPO_PRIMARY, "plot": HACPO_PLOT, "gate": HACPO_GATE,
                           # 3 seeds, and accuracy jumps by tens of points between iterations:
                           # the report lists every run's curve, not only the means
                           "per_iteration": True,
                           "contenders": ["gspo", "gspo_xn", "hacpo", "hacpo_cw0"],
                           # a run takes 17-43 min here: the dev sweep covers HACPO and GSPO only;
                           # the control changes only the cross weight and takes HACPO's lr, GSPO x n
                           # only the sample count and takes GSPO's (declared before the runs)
                           "tuned_as": {"hacpo_cw0": "hacpo", "gspo_xn": "gspo"}},
            "worked": {"about": "the embedded pool writing worked solutions of tens of tokens (data=arith_worked)",
                       "base": [*HACPO_STEP, "experiment.iterations=5", "data=arith_worked",
                                "rollout.max_new_tokens=40", "eval.max_new_tokens=40", *BEFORE_CLAMP],
                       "primary": HACPO_PRIMARY, "plot": HACPO_PLOT, "gate": HACPO_GATE,
                       "contenders": CORE},
        },
        "all": HACPO_CONTENDERS,
        "claims": HACPO_CLAIMS,
        "tuned_as": HACPO_TUNED_AS,
    },
    "mutual": {
        "settings": {
            "default": {"about": "the embedded pool (three tokenizers), boxed answers",
                        "base": [*MUTUAL_STEP, "experiment.iterations=6", *BEFORE_CLAMP],
                        "primary": MUTUAL_PRIMARY, "plot": MUTUAL_PLOT,
                        "contenders": MUTUAL_CORE},
            "worked": {"about": "the embedded pool writing worked solutions of tens of tokens (data=arith_worked)",
                       "base": [*MUTUAL_STEP, "experiment.iterations=5", "data=arith_worked",
                                "rollout.max_new_tokens=40", "eval.max_new_tokens=40", *BEFORE_CLAMP],
                       "primary": MUTUAL_PRIMARY, "plot": MUTUAL_PLOT,
                       "contenders": MUTUAL_CORE},
        },
        "all": MUTUAL_CONTENDERS,
        "claims": MUTUAL_CLAIMS,
        "tuned_as": MUTUAL_TUNED_AS,
    },
}
