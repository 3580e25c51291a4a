#!/usr/bin/env bash
# The old name of experiments/device_jobs.sh (sessions 8-10 called it so), kept as an alias that
# writes the old file names ($OUT/s8.json, $OUT/s8.log). Delete once no caller names it.
JOBS_NAME=${JOBS_NAME:-s8} exec bash "$(dirname "$0")/device_jobs.sh" "$@"
