#!/usr/bin/env bash
# Regenerates tests/interop/fixtures/ with Apache Avro Java (Debian's libavro-java).
# Needs: apt-get install -y libavro-java   (and a JDK >= 11 for single-file source launch)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
J=/usr/share/java
CP="$J/avro.jar:$J/jackson-core-asl.jar:$J/jackson-mapper-asl.jar:$J/slf4j-api.jar:$J/slf4j-nop.jar"
exec java -cp "$CP" "$here/GenFixtures.java" "$here/../../schemas" "$here/fixtures"
