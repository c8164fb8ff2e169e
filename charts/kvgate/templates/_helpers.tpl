{{/*
Names. A release named "kvgate" (or containing it) gets the names of envoy/k8s: kvgate-config,
kvgate-sync, kvgate-sync-key, kvgate-sidecar.
*/}}
{{- define "kvgate.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "kvgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kvgate.istio" -}}
{{- if eq .Values.gateway.type "istio" }}true{{ end -}}
{{- end -}}

{{/* Where the gateway pods run, and with them the sidecar's ConfigMap, key Secret and sync Service. */}}
{{- define "kvgate.namespace" -}}
{{- if include "kvgate.istio" . -}}
{{- .Release.Namespace -}}
{{- else -}}
{{- .Values.envoyGateway.proxyNamespace -}}
{{- end -}}
{{- end -}}

{{/* The labels that select the gateway pods: Istio's gateway-chart convention, or Envoy Gateway's own. */}}
{{- define "kvgate.podSelector" -}}
{{- if include "kvgate.istio" . -}}
app: {{ .Values.istio.name }}
istio: {{ .Values.istio.name | trimPrefix "istio-" }}
{{- else -}}
app.kubernetes.io/name: envoy
app.kubernetes.io/component: proxy
app.kubernetes.io/managed-by: envoy-gateway
gateway.envoyproxy.io/owning-gateway-name: {{ .Values.envoyGateway.gateway.name }}
gateway.envoyproxy.io/owning-gateway-namespace: {{ .Release.Namespace }}
{{- end -}}
{{- end -}}

{{/* The Envoy cluster of the sidecar, which the filter's sidecar_cluster names. */}}
{{- define "kvgate.sidecarCluster" -}}
{{- include "kvgate.fullname" . }}-sidecar
{{- end -}}

{{- define "kvgate.syncService" -}}
{{- include "kvgate.fullname" . }}-sync
{{- end -}}

{{- define "kvgate.syncSecret" -}}
{{- .Values.sync.existingSecret | default (printf "%s-sync-key" (include "kvgate.fullname" .)) -}}
{{- end -}}

{{- define "kvgate.configMap" -}}
{{- include "kvgate.fullname" . }}-config
{{- end -}}

{{- define "kvgate.sidecarImage" -}}
{{- $repo := required "sidecar.image.repository: the kvgate-sidecar image (sidecar/Dockerfile), e.g. registry.example.com/kvgate-sidecar" .Values.sidecar.image.repository -}}
{{- printf "%s:%s" $repo (.Values.sidecar.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* The filter image's digest, hex only. */}}
{{- define "kvgate.filterSha256" -}}
{{- required "filter.sha256: the filter image's digest (`cargo xtask package` prints it on its image: line)" .Values.filter.sha256 | trimPrefix "sha256:" -}}
{{- end -}}

{{- define "kvgate.filterImage" -}}
{{- required "filter.image: the filter's OCI image, e.g. registry.example.com/kvgate-filter:0.1.0" .Values.filter.image | trimPrefix "oci://" -}}
{{- end -}}

{{/* The engines' Envoy clusters, which get override_host (JSON list). */}}
{{- define "kvgate.engineClusters" -}}
{{- $out := list -}}
{{- if include "kvgate.istio" . -}}
{{- range .Values.istio.engineServices -}}
{{- $out = append $out (printf "outbound|%d||%s" (int .port) .host) -}}
{{- end -}}
{{- else -}}
{{- range .Values.envoyGateway.engineRoutes -}}
{{- $out = append $out (printf "httproute/%s/%s/rule/%d" .namespace .name (int .rule)) -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/*
The pools with poolDefaults applied (JSON list): a pool's own keys win, key by key, also
inside `discovery`.
*/}}
{{- define "kvgate.pools" -}}
{{- $out := list -}}
{{- range $p := .Values.pools -}}
{{- $pool := deepCopy $p -}}
{{- range $k, $v := omit $.Values.poolDefaults "discovery" -}}
{{- if not (hasKey $pool $k) }}{{ $_ := set $pool $k $v }}{{ end -}}
{{- end -}}
{{- $d := deepCopy (default (dict) $pool.discovery) -}}
{{- range $k, $v := default (dict) $.Values.poolDefaults.discovery -}}
{{- if not (hasKey $d $k) }}{{ $_ := set $d $k $v }}{{ end -}}
{{- end -}}
{{- $_ := set $pool "discovery" $d -}}
{{- $out = append $out $pool -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* Where pool $i's tokenizer is in the sidecar: its image path, or the volume the chart mounts. */}}
{{- define "kvgate.tokenizerDir" -}}
{{- $i := index . 0 -}}{{- $pool := index . 1 -}}
{{- if $pool.tokenizer.path -}}
{{- $pool.tokenizer.path -}}
{{- else -}}
/tokenizers/{{ $i }}
{{- end -}}
{{- end -}}

{{/*
A TOML table's keys: scalars and lists of scalars, each written as JSON, which is TOML for
these (strings, integers, floats, booleans, arrays). Tables are left to the caller; null and
"" are left out.
*/}}
{{- define "kvgate.tomlKeys" -}}
{{- range $k, $v := . -}}
{{- if not (or (kindIs "map" $v) (kindIs "invalid" $v) (and (kindIs "string" $v) (eq $v ""))) }}
{{ $k }} = {{ toJson $v }}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The sidecar's kvgate.toml. */}}
{{- define "kvgate.config" -}}
# kvgate-sidecar configuration, rendered by the kvgate chart (mounted at /etc/kvgate/kvgate.toml).
# The API stays on loopback: only this pod's Envoy calls it. Metrics and probes are on
# metrics_listen for Prometheus and the kubelet.
listen = "127.0.0.1:{{ .Values.sidecar.ports.api | int }}"
metrics_listen = "0.0.0.0:{{ .Values.sidecar.ports.metrics | int }}"
# The view saved for the sidecar's next start (an emptyDir: it outlives a container restart).
state_file = "/var/lib/kvgate/state/view.bin"
{{- include "kvgate.tomlKeys" (omit .Values.sidecar.config "scoring") }}
{{- with .Values.sidecar.config.scoring }}

[scoring]
{{- include "kvgate.tomlKeys" . }}
{{- end }}
{{- if .Values.sync.enabled }}

# Bookings shared with the other gateway pods (peers: the addresses of the headless sync
# Service). Each pod binds its own IP (KVGATE_SYNC_LISTEN replaces this loopback address) and
# seals every message with the key mounted from the Secret {{ include "kvgate.syncSecret" . }}.
[sync]
listen = "tcp://127.0.0.1:{{ .Values.sync.port | int }}"
peers_dns = "{{ include "kvgate.syncService" . }}.{{ include "kvgate.namespace" . }}.svc.{{ .Values.clusterDomain }}"
key_file = "/etc/kvgate/sync-key/key"
{{- include "kvgate.tomlKeys" .Values.sync.config }}
{{- end }}
{{- range $i, $pool := include "kvgate.pools" . | fromJsonArray }}

[[pools]]
model = {{ $pool.model | toJson }}
{{- include "kvgate.tomlKeys" (omit $pool "model" "tokenizer" "discovery" "admission" "disaggregation" "sessions" "extraToml") }}
tokenizer = {{ include "kvgate.tokenizerDir" (list $i $pool) | toJson }}
{{- with $pool.extraToml }}
{{ . | trim }}
{{- end }}

[pools.discovery]
{{- include "kvgate.tomlKeys" $pool.discovery }}
{{- with $pool.disaggregation }}

[pools.disaggregation]
{{- include "kvgate.tomlKeys" . }}
{{- end }}
{{- with $pool.sessions }}

[pools.sessions]
{{- include "kvgate.tomlKeys" . }}
{{- end }}
{{- with $pool.admission }}

[pools.admission]
{{- include "kvgate.tomlKeys" (omit . "classes") }}
{{- range .classes }}

[[pools.admission.classes]]
{{- include "kvgate.tomlKeys" . }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
The filter's configuration (JSON): filter.config with the chart's sidecar cluster and, when a
pool disaggregates and none is named, the first engine cluster as prefill_cluster.
*/}}
{{- define "kvgate.filterConfig" -}}
{{- $c := dict -}}
{{- range $k, $v := .Values.filter.config -}}
{{- if not (or (kindIs "invalid" $v) (and (kindIs "string" $v) (eq $v ""))) }}{{ $_ := set $c $k $v }}{{ end -}}
{{- end -}}
{{- $_ := set $c "sidecar_cluster" (include "kvgate.sidecarCluster" .) -}}
{{- $disaggregated := false -}}
{{- range .Values.pools }}{{ if .disaggregation }}{{ $disaggregated = true }}{{ end }}{{ end -}}
{{- if and $disaggregated (not (hasKey $c "prefill_cluster")) -}}
{{- $clusters := include "kvgate.engineClusters" . | fromJsonArray -}}
{{- if $clusters }}{{ $_ := set $c "prefill_cluster" (first $clusters) }}{{ end -}}
{{- end -}}
{{- toJson $c -}}
{{- end -}}

{{/* The sidecar container, as envoy/k8s/components/gateway-sidecar has it. */}}
{{- define "kvgate.sidecarContainer" -}}
{{- $sync := .Values.sync.port | int -}}
{{- $metrics := .Values.sidecar.ports.metrics | int -}}
- name: kvgate-sidecar
  image: {{ include "kvgate.sidecarImage" . }}
  {{- with .Values.sidecar.image.pullPolicy }}
  imagePullPolicy: {{ . }}
  {{- end }}
  args: ["--config", "/etc/kvgate/kvgate.toml"]
  {{- /* text, the sidecar's default, is left out: the container stays the component's. */}}
  {{- $logFormat := .Values.sidecar.logFormat | default "text" }}
  {{- $collector := .Values.tracing.collector }}
  {{- if or .Values.sync.enabled .Values.sidecar.env (ne $logFormat "text") $collector.name }}
  env:
  {{- if .Values.sync.enabled }}
  # The gateway mesh binds the pod's own IP, never 0.0.0.0.
  - name: POD_IP
    valueFrom: {fieldRef: {fieldPath: status.podIP}}
  - {name: KVGATE_SYNC_LISTEN, value: "tcp://$(POD_IP):{{ $sync }}"}
  {{- end }}
  {{- if ne $logFormat "text" }}
  - {name: KVGATE_LOG_FORMAT, value: {{ $logFormat | quote }}}
  {{- end }}
  {{- if $collector.name }}
  # Decision spans over OTLP/HTTP, sampled as the gateway samples (values: tracing).
  - {name: OTEL_EXPORTER_OTLP_ENDPOINT, value: "http://{{ $collector.name }}.{{ $collector.namespace }}.svc:{{ $collector.httpPort }}"}
  - {name: OTEL_TRACES_SAMPLER, value: parentbased_traceidratio}
  - {name: OTEL_TRACES_SAMPLER_ARG, value: {{ divf .Values.tracing.samplingPercent 100 | quote }}}
  {{- end }}
  {{- with .Values.sidecar.env }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
  {{- end }}
  ports:
  - {name: kvgate-metrics, containerPort: {{ $metrics }}}
  {{- if .Values.sync.enabled }}
  - {name: tcp-kvgate-sync, containerPort: {{ $sync }}}
  - {name: tcp-kvgate-handover, containerPort: {{ add1 $sync }}}
  {{- end }}
  # No readinessProbe: a pod is Ready only when all its containers are, and the gateway must
  # keep serving (kvgate fails open) whatever state the sidecar is in. /livez restarts a
  # sidecar that stops answering at all; its own state is on /healthz, for alerts.
  livenessProbe:
    httpGet: {path: /livez, port: {{ $metrics }}}
    periodSeconds: 10
    failureThreshold: 6
  {{- with .Values.sidecar.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- include "kvgate.securityContext" . | nindent 4 }}
  volumeMounts:
  - {name: kvgate-config, mountPath: /etc/kvgate, readOnly: true}
  {{- if .Values.sync.enabled }}
  - {name: kvgate-sync-key, mountPath: /etc/kvgate/sync-key, readOnly: true}
  {{- end }}
  - {name: kvgate-state, mountPath: /var/lib/kvgate/state}
  {{- range $i, $pool := .Values.pools }}
  {{- if not $pool.tokenizer.path }}
  - name: tokenizer-{{ $i }}
    mountPath: /tokenizers/{{ $i }}
    readOnly: true
    {{- with $pool.tokenizer.subPath }}
    subPath: {{ . }}
    {{- end }}
  {{- end }}
  {{- end }}
{{- end -}}

{{- define "kvgate.securityContext" -}}
runAsNonRoot: true
readOnlyRootFilesystem: true
allowPrivilegeEscalation: false
capabilities: {drop: [ALL]}
{{- end -}}

{{/* One init container per pool whose tokenizer comes from the Hub: the sidecar image fetches it. */}}
{{- define "kvgate.initContainers" -}}
{{- range $i, $pool := .Values.pools }}
{{- with $pool.tokenizer.hub }}
{{- $secret := .tokenSecret | default $.Values.tokenizerHub.tokenSecret }}
{{- $endpoint := .endpoint | default $.Values.tokenizerHub.endpoint }}
- name: fetch-tokenizer-{{ $i }}
  image: {{ include "kvgate.sidecarImage" $ }}
  {{- with $.Values.sidecar.image.pullPolicy }}
  imagePullPolicy: {{ . }}
  {{- end }}
  args:
  - fetch-tokenizer
  - --repo
  - {{ .repo | quote }}
  - --revision
  - {{ .revision | quote }}
  - --dest
  - /tokenizers/{{ $i }}
  {{- if or $secret.name $endpoint }}
  env:
  {{- if $secret.name }}
  - name: HF_TOKEN
    valueFrom:
      secretKeyRef: {name: {{ $secret.name | quote }}, key: {{ $secret.key | default "token" | quote }}}
  {{- end }}
  {{- with $endpoint }}
  - {name: HF_ENDPOINT, value: {{ . | quote }}}
  {{- end }}
  {{- end }}
  {{- with $.Values.tokenizerHub.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- include "kvgate.securityContext" $ | nindent 4 }}
  volumeMounts:
  - {name: tokenizer-{{ $i }}, mountPath: /tokenizers/{{ $i }}}
{{- end }}
{{- end }}
{{- end -}}

{{- define "kvgate.volumes" -}}
- name: kvgate-config
  configMap: {name: {{ include "kvgate.configMap" . }}}
{{- if .Values.sync.enabled }}
# The key sealing the gateways' sync and handover traffic.
- name: kvgate-sync-key
  secret: {secretName: {{ include "kvgate.syncSecret" . }}, defaultMode: 0444}  # mounted in the sidecar alone; it runs as non-root
{{- end }}
# The sidecar's saved view (state_file): a restarted sidecar container takes it over.
- name: kvgate-state
  emptyDir: {}
{{- range $i, $pool := .Values.pools }}
{{- if $pool.tokenizer.volume }}
- name: tokenizer-{{ $i }}
  {{- toYaml $pool.tokenizer.volume | nindent 2 }}
{{- else if $pool.tokenizer.hub }}
- name: tokenizer-{{ $i }}
  emptyDir: {}
{{- end }}
{{- end }}
{{- end -}}

{{/* Pod annotations the config's content rolls the pods on. */}}
{{- define "kvgate.checksum" -}}
checksum/kvgate-config: {{ include "kvgate.config" . | sha256sum }}
{{- end -}}
