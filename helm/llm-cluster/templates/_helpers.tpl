{{/* The release's base name, at most 40 characters: KubeRay derives longer names from it
(<name>-raycluster-xxxxx-head-svc) that must stay within 63. */}}
{{- define "llm-cluster.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "llm-cluster.labels" -}}
app.kubernetes.io/name: {{ default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "llm-cluster.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end -}}

{{/* The Serve application config (serveConfigV2): this project's app builder with the
deployment config as its args, the same document `cluster deploy CONFIG` reads. The app is
always behind Serve's proxy on every pod (no direct ingress), so any number of ingress
replicas serve the one port. */}}
{{- define "llm-cluster.serveConfig" -}}
{{- $args := dict "app_name" .Values.appName "models" .Values.models -}}
{{- $http := dict "host" "0.0.0.0" "port" .Values.http.port "max_body_bytes" .Values.http.maxBodyBytes -}}
{{- $_ := set $http "ingress_replicas" .Values.http.ingressReplicas -}}
{{- $_ := set $args "http_options" $http -}}
{{- with .Values.sleepMode -}}
{{- $_ := set $args "sleep_mode" . -}}
{{- end -}}
{{- with .Values.media -}}
{{- $_ := set $args "media" . -}}
{{- end -}}
{{- with .Values.responsesStore -}}
{{- $_ := set $args "responses_store" . -}}
{{- end -}}
{{- if .Values.grpc.enabled -}}
{{- $_ := set $args "grpc_options" (dict "port" .Values.grpc.port) -}}
{{- end -}}
{{- if .Values.apiKeys.secretName -}}
{{- $_ := set $args "api_keys" (dict "env" .Values.apiKeys.envVar) -}}
{{- end -}}
http_options:
  host: 0.0.0.0
  port: {{ .Values.http.port }}
  {{- if not (kindIs "invalid" .Values.http.requestTimeoutS) }}
  request_timeout_s: {{ .Values.http.requestTimeoutS }}
  {{- end }}
{{- if .Values.grpc.enabled }}
grpc_options:
  port: {{ .Values.grpc.port }}
  grpc_servicer_functions:
    - cluster.proto.llm_pb2_grpc.add_LLMServicer_to_server
{{- end }}
applications:
  - name: {{ .Values.appName }}
    route_prefix: /
    import_path: cluster.serving.serve:build_app
    args:
      {{- toYaml $args | nindent 6 }}
{{- end -}}

{{/* Environment of every Ray container: plain values, then Secret references (the
Secret's value never appears in the manifest). */}}
{{- define "llm-cluster.env" -}}
{{- range .Values.env }}
- name: {{ .name }}
  value: {{ .value | quote }}
{{- end }}
{{- if .Values.apiKeys.secretName }}
- name: {{ .Values.apiKeys.envVar }}
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKeys.secretName }}
      key: {{ .Values.apiKeys.secretKey }}
{{- end }}
{{- range .Values.secretEnv }}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ .secretName }}
      key: {{ .secretKey }}
{{- end }}
{{- end -}}

{{/* The checkpoint volume (none when modelStorage.type is none). */}}
{{- define "llm-cluster.modelVolume" -}}
{{- $s := .Values.modelStorage -}}
{{- if eq $s.type "pvc" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ required "modelStorage.pvc.claimName is required for type pvc" $s.pvc.claimName }}
    readOnly: {{ $s.pvc.readOnly }}
{{- else if eq $s.type "hostPath" }}
- name: models
  hostPath:
    path: {{ required "modelStorage.hostPath.path is required for type hostPath" $s.hostPath.path }}
    type: Directory
{{- else if eq $s.type "uri" }}
- name: models
  emptyDir:
    sizeLimit: {{ $s.uri.sizeLimit }}
{{- end }}
{{- end -}}

{{- define "llm-cluster.modelMount" -}}
{{- $s := .Values.modelStorage -}}
{{- if ne $s.type "none" }}
- name: models
  mountPath: {{ $s.mountPath }}
  readOnly: {{ ne $s.type "uri" }}
{{- end }}
{{- end -}}

{{/* For modelStorage.type uri: copy the checkpoint before Ray starts. */}}
{{- define "llm-cluster.modelInit" -}}
{{- $s := .Values.modelStorage -}}
{{- if eq $s.type "uri" }}
initContainers:
  - name: fetch-model
    image: {{ $s.uri.image }}
    command: {{ toJson $s.uri.command }}
    env:
      - name: MODEL_URI
        value: {{ required "modelStorage.uri.uri is required for type uri" $s.uri.uri | quote }}
      - name: MODEL_DIR
        value: {{ $s.mountPath | quote }}
      {{- range $.Values.secretEnv }}
      - name: {{ .name }}
        valueFrom:
          secretKeyRef:
            name: {{ .secretName }}
            key: {{ .secretKey }}
      {{- end }}
    volumeMounts:
      - name: models
        mountPath: {{ $s.mountPath }}
{{- end }}
{{- end -}}
