"""Preflight: static checks of a target, draft and serving flags before anything is served."""
