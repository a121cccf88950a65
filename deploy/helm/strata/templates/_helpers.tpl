{{/* Names and labels. */}}
{{- define "strata.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "strata.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "strata.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "strata.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "strata.selectorLabels" -}}
app.kubernetes.io/name: {{ include "strata.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "strata.labels" -}}
{{ include "strata.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "strata.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* Prometheus discovers pods by these (deploy/prometheus/prometheus-kubernetes.yml). */}}
{{- define "strata.podAnnotations" -}}
{{- if .root.Values.metrics.podAnnotations -}}
annotations:
  prometheus.io/scrape: "true"
  prometheus.io/port: {{ .port | quote }}
  prometheus.io/path: /metrics
{{- end -}}
{{- end -}}

{{/* State URLs: redis://:PASSWORD@HOST:PORT of the release's Redis (the password from the keys
     Secret, expanded by Kubernetes from the container's env), or the external one, then a DB. */}}
{{- define "strata.redisBase" -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://:$(STRATA_REDIS_PASSWORD)@%s-redis:6379" (include "strata.fullname" .) -}}
{{- else -}}
{{- required "redis.enabled is false: set redis.externalUrl (redis://HOST:PORT)" .Values.redis.externalUrl | trimSuffix "/" -}}
{{- end -}}
{{- end -}}

{{- define "strata.registryUrl" -}}
{{- .Values.registry.url | default (printf "%s/0" (include "strata.redisBase" .)) -}}
{{- end -}}

{{- define "strata.sessionsUrl" -}}
{{- .Values.sessions.storeUrl | default (printf "%s/1" (include "strata.redisBase" .)) -}}
{{- end -}}

{{- define "strata.responseCacheUrl" -}}
{{- .Values.gateway.responseCache.url | default (printf "%s/2" (include "strata.redisBase" .)) -}}
{{- end -}}

{{- define "strata.rayRegistryUrl" -}}
{{- .Values.ray.registryUrl | default (printf "%s/3" (include "strata.redisBase" .)) -}}
{{- end -}}

{{/* The Secret holding the fleet's keys and Redis's password: the one named, else the chart's. */}}
{{- define "strata.keysSecret" -}}
{{- .Values.keys.existingSecret | default (printf "%s-keys" (include "strata.fullname" .)) -}}
{{- end -}}

{{- define "strata.keyNames" -}}
STRATA_API_KEYS STRATA_ADMIN_KEYS STRATA_INTERNAL_KEYS STRATA_REDIS_PASSWORD
{{- end -}}

{{/* Every key as an env var from the Secret (strata reads STRATA_*_KEYS; the Redis URLs and the
     Redis server take $(STRATA_REDIS_PASSWORD)). */}}
{{- define "strata.keysEnv" -}}
{{- $secret := include "strata.keysSecret" . -}}
{{- range $name := splitList " " (include "strata.keyNames" .) }}
- name: {{ $name }}
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: {{ $name }}
{{- end }}
{{- end -}}

{{/* An instance group: instanceDefaults overridden by one entry of `instances`. */}}
{{- define "strata.group" -}}
{{- $group := mergeOverwrite (deepCopy .root.Values.instanceDefaults) .entry -}}
{{- toYaml $group -}}
{{- end -}}

{{- define "strata.groupFullname" -}}
{{- printf "%s-instance-%s" (include "strata.fullname" .root) .group.name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "strata.groupSelectorLabels" -}}
{{ include "strata.selectorLabels" .root }}
app.kubernetes.io/component: instance
strata.dev/group: {{ .group.name | quote }}
{{- end -}}

{{- define "strata.groupLabels" -}}
{{ include "strata.labels" .root }}
app.kubernetes.io/component: instance
strata.dev/group: {{ .group.name | quote }}
strata.dev/model-version: {{ .group.modelVersion | quote }}
{{- end -}}

{{/* The pod's grace period: the drain, then strata's own graceful shutdown, then a margin. */}}
{{- define "strata.groupGraceSeconds" -}}
{{- $drain := int .group.drain.timeoutSeconds -}}
{{- $shutdown := int .group.shutdownTimeoutSeconds -}}
{{- if kindIs "invalid" .group.terminationGracePeriodSeconds -}}
{{- add $drain $shutdown 15 -}}
{{- else -}}
{{- $grace := int .group.terminationGracePeriodSeconds -}}
{{- if le $grace (add $drain $shutdown) -}}
{{- fail (printf "instances[%s]: terminationGracePeriodSeconds (%d) must be longer than drain.timeoutSeconds + shutdownTimeoutSeconds (%d)" .group.name $grace (add $drain $shutdown)) -}}
{{- end -}}
{{- $grace -}}
{{- end -}}
{{- end -}}
