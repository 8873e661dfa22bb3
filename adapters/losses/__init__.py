"""Losses that work on one rank or many: contrastive (InfoNCE, gathered) and PowerCLIP's powerset alignment (nla)."""
