#!/bin/sh
# Start Redis (or Valkey) with ops/redis/redis.conf and the ACL users of ops/redis/users.acl, the
# passwords taken from the environment: FERRY_REDIS_WORKER_PASSWORD, FERRY_REDIS_KVCACHE_PASSWORD,
# FERRY_REDIS_ADMIN_PASSWORD (URL-safe: letters, digits, - and _; they go into redis:// URLs).
#
#   start.sh <server binary> [more redis-server arguments...]
# e.g. start.sh redis-server --maxmemory 8gb        (compose)
#      start.sh valkey-server --maxmemory 24gb      (ops/k8s/redis.yaml)
# The filled-in ACL file is written to a private temporary file, never to this folder.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
server=${1:?usage: start.sh <redis-server|valkey-server> [arguments...]}
shift
script=""
for role in WORKER KVCACHE ADMIN; do
    var="FERRY_REDIS_${role}_PASSWORD"
    eval "value=\${$var:-}"
    case "$value" in
        "") echo "ferry redis: $var is not set (python ops/make_secrets.py makes every secret)" >&2; exit 2 ;;
        *[!A-Za-z0-9_-]*) echo "ferry redis: $var must be URL-safe (letters, digits, - and _)" >&2; exit 2 ;;
    esac
    script="${script}s|\${$var}|$value|g;"
done
umask 077
acl=$(mktemp "${TMPDIR:-/tmp}/ferry-users.XXXXXX")
sed -e "/^#/d" -e "/^$/d" -e "$script" "$here/users.acl" > "$acl"
exec "$server" "$here/redis.conf" --aclfile "$acl" "$@"
