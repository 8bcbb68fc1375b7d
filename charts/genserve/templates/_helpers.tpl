{{/* The chart's name, at most 63 characters (a DNS label). */}}
{{- define "genserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's base name: the prefix of every object's name. */}}
{{- define "genserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "genserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "genserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: genserve
{{- end }}

{{/* Selector labels of one component; call with (dict "ctx" $ "component" "engine"). */}}
{{- define "genserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "genserve.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Object names. */}}
{{- define "genserve.engine.fullname" -}}{{ include "genserve.fullname" . | trunc 56 | trimSuffix "-" }}-engine{{- end }}
{{- define "genserve.bridge.fullname" -}}{{ include "genserve.fullname" . | trunc 56 | trimSuffix "-" }}-bridge{{- end }}
{{- define "genserve.envoy.fullname" -}}{{ include "genserve.fullname" . | trunc 57 | trimSuffix "-" }}-envoy{{- end }}
{{- define "genserve.apiKeys.secretName" -}}
{{- .Values.apiKeys.existingSecret | default (printf "%s-api-keys" (include "genserve.fullname" . | trunc 54 | trimSuffix "-")) }}
{{- end }}

{{/* The in-cluster DNS name of a Service of this release; call with (dict "ctx" $ "name" NAME). */}}
{{- define "genserve.serviceHost" -}}
{{ .name }}.{{ .ctx.Release.Namespace }}.svc.{{ .ctx.Values.clusterDomain }}
{{- end }}

{{/* Envoy's upstream endpoints as a JSON list of {host, port}: the values, or the chart's Services. */}}
{{- define "genserve.envoy.bridgeEndpoints" -}}
{{- if .Values.envoy.upstreams.bridge }}
{{- toJson .Values.envoy.upstreams.bridge }}
{{- else }}
{{- toJson (list (dict "host" (include "genserve.serviceHost" (dict "ctx" . "name" (include "genserve.bridge.fullname" .))) "port" .Values.bridge.port)) }}
{{- end }}
{{- end }}

{{- define "genserve.envoy.engineEndpoints" -}}
{{- if .Values.envoy.upstreams.engines }}
{{- toJson .Values.envoy.upstreams.engines }}
{{- else }}
{{- toJson (list (dict "host" (include "genserve.serviceHost" (dict "ctx" . "name" (include "genserve.engine.fullname" .))) "port" .Values.engine.grpcPort)) }}
{{- end }}
{{- end }}

{{/* The engine's termination grace: preStop sleep + drain grace + margin, seconds (an integer). */}}
{{- define "genserve.engine.terminationGracePeriodSeconds" -}}
{{- $e := .Values.engine }}
{{- add (int $e.preStopSleepSeconds) (int (ceil $e.drainGraceSeconds)) (int $e.terminationMarginSeconds) }}
{{- end }}

{{- define "genserve.image" -}}
{{ .repository }}:{{ .tag }}
{{- end }}

{{/* Envoy's cluster_type for upstream DNS names, strict DNS: every address a name resolves to is
an endpoint (one per pod of a headless Service). This is the typed form of `type: STRICT_DNS`,
whose dns_refresh_rate field Envoy 1.40 deprecates. Call with .Values.envoy. */}}
{{- define "genserve.envoy.strictDns" -}}
name: envoy.clusters.dns
typed_config:
  "@type": type.googleapis.com/envoy.extensions.clusters.dns.v3.DnsCluster
  all_addresses_in_single_endpoint: false
  dns_lookup_family: V4_PREFERRED
  dns_refresh_rate: {{ .dnsRefreshRate }}
  respect_dns_ttl: false
{{- end }}
