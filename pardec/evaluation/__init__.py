"""Evaluation through EleutherAI's lm-evaluation-harness (the optional ``eval`` extra, ``lm-eval`` 0.4).

``pardec.evaluation.model`` registers the lm-eval model ``pardec`` (any checkpoint, generation by any pardec
decoder, decoder stats beside lm-eval's scores); ``pardec.evaluation.stopping`` replays lm-eval's HF stop
rules on a decoder's output; ``pardec.evaluation.synthetic_task`` writes the offline lm-eval task of the
embedded synthetic GSM test split. Guide: docs/guide/lm_eval.md.
"""
