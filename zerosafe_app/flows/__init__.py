"""Prefect flows of zerosafe: `convert` (one checkpoint tag) and `watch` (new tags as they land)."""
