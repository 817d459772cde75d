"""``fingerprint.json``: the one definition of its format."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from pd_build.info import BuildInfo

FINGERPRINT_FILE = "fingerprint.json"
SUMMARY_FILE = "summary.md"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RecipeRecord(_Strict):
    name: str
    source: str  # the file it was rendered from
    sha256: str  # of the recipe file's bytes (text below)
    text: str


class StepRecord(_Strict):
    """One process of the job, as it was (or will be) started."""

    id: str
    role: str  # convert, prefill, decode, router, fingerprint, benchmark, summary
    node: int
    host: str
    image: str | None  # container image (none: plain process)
    command: list[str]  # the exact argv, host names and job directory filled in
    command_line: str  # the same, shell-quoted
    env: dict[str, str]  # the environment the step adds (tokens masked)


class ServiceRecord(StepRecord):
    """A server (prefill, decode, router) and what its ``/metrics`` said it runs."""

    url: str
    metrics_url: str
    build: list[BuildInfo]  # from its *_build_info (one per vLLM engine); empty: see absent
    absent: str | None = None  # why there is no build info


class Fingerprint(_Strict):
    schema_version: Literal[1] = 1
    kind: Literal["job", "dry-run"]
    created: str  # UTC, ISO 8601
    job_id: str | None
    job_dir: str
    hosts: list[str]
    recipe: RecipeRecord
    services: list[ServiceRecord]  # decode servers, prefill, router (start order)
    steps: list[StepRecord]  # every other step: conversion, benchmarks, reports
    server_metrics: list[str]  # the /metrics URLs the benchmark collects (aiperf --server-metrics)
    environment: BuildInfo  # where this file was written (the router's environment in a job)
