{{/* Names: <release>-dspark-serve-<component>, trimmed to 63 characters. */}}
{{- define "dspark.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "dspark.name" -}}
{{- printf "%s-%s" (include "dspark.fullname" .root) .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "dspark.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "dspark.labels" -}}
{{ include "dspark.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{- define "dspark.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* etcd endpoints, comma-separated. */}}
{{- define "dspark.etcdEndpoints" -}}
{{- if .Values.etcd.endpoints -}}
{{- join "," .Values.etcd.endpoints -}}
{{- else -}}
{{- printf "http://%s:%v" (include "dspark.name" (dict "root" . "component" "etcd")) .Values.etcd.clientPort -}}
{{- end -}}
{{- end -}}

{{- define "dspark.schedulerUrl" -}}
{{- printf "http://%s:%v" (include "dspark.name" (dict "root" . "component" "scheduler")) .Values.scheduler.port -}}
{{- end -}}

{{/* Environment every dspark container shares. */}}
{{- define "dspark.commonEnv" -}}
- name: DSPARK_LOG
  value: {{ .Values.logLevel | quote }}
- name: HOME
  value: /tmp
{{- with .Values.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
{{- end }}
{{- end -}}

{{/* The Secret holding the shared cluster token: the user's, or the one the chart keeps. */}}
{{- define "dspark.clusterTokenSecret" -}}
{{- .Values.clusterToken.existingSecret | default (include "dspark.name" (dict "root" . "component" "cluster-token")) -}}
{{- end -}}

{{/* The shared cluster token, for the containers that serve or call gRPC (the scheduler, the
workers, the router); not the init containers or tensor-parallel ranks, which take none. */}}
{{- define "dspark.clusterTokenEnv" -}}
{{- if .Values.clusterToken.enabled }}
- name: DSPARK_CLUSTER_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "dspark.clusterTokenSecret" . }}
      key: {{ .Values.clusterToken.key }}
{{- end }}
{{- end -}}

{{/* Downward API: workers publish their pod IP and register under their pod name. */}}
{{- define "dspark.workerEnv" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: DSPARK_ADVERTISE
  value: $(POD_IP)
- name: DSPARK_WORKER_ID
  value: $(POD_NAME)
- name: DSPARK_ETCD
  value: {{ include "dspark.etcdEndpoints" . | quote }}
- name: DSPARK_SCHEDULER
  value: {{ include "dspark.schedulerUrl" . | quote }}
- name: DSPARK_TTL_MS
  value: {{ .Values.registrationTtlMs | quote }}
{{- end -}}

{{/* Volumes every dspark pod mounts: the model cache and a writable /tmp. */}}
{{- define "dspark.volumes" -}}
- name: model-cache
{{- if .Values.modelCache.existingClaim }}
  persistentVolumeClaim:
    claimName: {{ .Values.modelCache.existingClaim }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.modelCache.sizeLimit }}
{{- end }}
- name: tmp
  emptyDir: {}
{{- end -}}

{{/* The model cache every pod but the scheduler's uses. */}}
{{- define "dspark.cacheEnv" -}}
- name: DSPARK_HOME
  value: {{ .Values.modelCache.mountPath | quote }}
{{- end -}}

{{- define "dspark.volumeMounts" -}}
- name: model-cache
  mountPath: {{ .Values.modelCache.mountPath }}
- name: tmp
  mountPath: /tmp
{{- end -}}

{{- /*
Refuses a bare drafter kind the model has no default for (the draft worker would exit at
start): `draft-model` pairs only qwen2.5-coder-1.5b (with qwen2.5-coder-0.5b; the pairing is
keyed on the model's name, so a path has none), `dspark` only a model with a drafter under the
repository's drafters/ (smollm2-135m). A path is checked for draft-model only.
*/ -}}
{{- define "dspark.checkDrafter" -}}
{{- $m := .Values.model -}}
{{- if and (eq .Values.drafter "draft-model") (ne $m "qwen2.5-coder-1.5b") }}
{{- fail (printf "drafter: bare `draft-model` has a default draft model only for qwen2.5-coder-1.5b; for model %s name one: draft-model:NAME" $m) }}
{{- end }}
{{- if and (eq .Values.drafter "dspark") (ne $m "smollm2-135m") (not (or (contains "/" $m) (hasSuffix ".gguf" $m))) }}
{{- fail (printf "drafter: bare `dspark` needs the shipped drafter, which only smollm2-135m has; for model %s train one (dspark train-drafter) and set dspark:DIR, or use ngram" $m) }}
{{- end }}
{{- end -}}

{{/* Fetches the model into the cache before the main container starts. */}}
{{- /*
The init container that fetches the model (and, given a drafter that loads one, its draft
model) into the cache before the main container starts. A path (anything with a "/" or a
.gguf name) is the user's own file: nothing to fetch. Called with (dict "root" . "drafter" KIND).
*/ -}}
{{- define "dspark.fetchModel" -}}
{{- $m := .root.Values.model -}}
{{- if not (or (contains "/" $m) (hasSuffix ".gguf" $m)) }}
- name: fetch-model
  image: {{ include "dspark.image" .root }}
  imagePullPolicy: {{ .root.Values.image.pullPolicy }}
  command: ["dspark"]
  args: ["fetch-model", {{ $m | quote }}{{ with .drafter }}, "--drafter", {{ . | quote }}{{ end }}]
  env:
    {{- include "dspark.commonEnv" .root | nindent 4 }}
    {{- include "dspark.cacheEnv" .root | nindent 4 }}
  volumeMounts:
    {{- include "dspark.volumeMounts" .root | nindent 4 }}
  securityContext:
    {{- toYaml .root.Values.securityContext | nindent 4 }}
{{- end }}
{{- end -}}

{{- define "dspark.podCommon" -}}
{{- /* No pod calls the Kubernetes API: no service account token in it. */ -}}
automountServiceAccountToken: false
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/*
DSPARK_THREADS: the value given, or with 0 the container's CPU request rounded up to whole
cores (the downward API; 0 again where it requests none). Without it a worker whose container
has no CPU limit would size its thread pool to every core of the node and contend with the
other pods there.
*/}}
{{- define "dspark.threadsEnv" -}}
- name: DSPARK_THREADS
{{- if gt (int .threads) 0 }}
  value: {{ .threads | quote }}
{{- else }}
  valueFrom:
    resourceFieldRef:
      containerName: {{ .container }}
      resource: requests.cpu
      divisor: "1"
{{- end }}
{{- end -}}
