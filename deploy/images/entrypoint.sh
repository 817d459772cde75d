#!/usr/bin/env bash
# Entrypoint of both images (Dockerfile.prefill, Dockerfile.decode):
#
#   entrypoint.sh ROLE [EXTRA SERVER ARGS...]      ROLE: prefill | decode | router
#   entrypoint.sh wait-ready URL...                 until every URL answers 200 (init containers)
#
# The role's settings come from PD_* environment variables (listed in
# pd_deploy/launch.py and docs/deploy.md); the command is built by the same
# code as the Slurm plan and the local launcher, then replaces this shell.
set -euo pipefail

case ${1:-} in
    prefill|decode|router|wait-ready) ;;
    *) echo "usage: entrypoint.sh {prefill|decode|router} [extra server args...] | wait-ready URL..." >&2
       exit 2 ;;
esac
exec "${PD_LAUNCH_PYTHON:-python3}" -m pd_deploy.launch "$@"
