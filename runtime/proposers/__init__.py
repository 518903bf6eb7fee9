"""Proposers: one file each, one interface (base.Proposer), chosen once at construction."""
