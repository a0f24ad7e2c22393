#!/usr/bin/env node
// A Node.js client of Blazar's public gRPC API, blazar.v1.Inference.
//
// It loads the service from the repository's own .proto files at run time (no
// generated code, no copies), then:
//   1. lists the models the daemon serves (ListModels),
//   2. streams a chat, printing each text delta as it arrives (Chat),
//   3. makes one forced tool call (tool_choice naming a tool) and prints the call's
//      name and its arguments, parsed as JSON.
// Any error exits with status 1 and says why on stderr.
//
//   npm ci
//   BLAZAR_GRPC_ADDR=127.0.0.1:8421 node chat.js
//
// Environment: BLAZAR_GRPC_ADDR (host:port, default 127.0.0.1:8421, as `blazar serve`);
// BLAZAR_MODEL (a Lane name or alias; default: the first model that is ready);
// BLAZAR_API_KEY (a tenant's key, for a daemon started with --auth-file).
"use strict";

const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const protobuf = require("protobufjs");

const PROTO_ROOT = path.resolve(__dirname, "..", "..", "proto");
const ADDRESS = process.env.BLAZAR_GRPC_ADDR || "127.0.0.1:8421";
const API_KEY = process.env.BLAZAR_API_KEY || "";
// The tool the model is made to call: name, description and JSON Schema parameters.
const TOOL = require("./tool.json");
// Every call gets a deadline: a daemon that hangs must not hang the client.
const DEADLINE_MS = 120_000;

function loadInference() {
  const definition = protoLoader.loadSync("blazar/v1/inference.proto", {
    includeDirs: [PROTO_ROOT],
    keepCase: true, // field names as in the .proto: max_tokens, tool_choice, ...
    enums: String, // "FINISH_REASON_TOOL_CALLS" rather than 4
    // int64 fields (ModelInfo.created, ModelFile.size_bytes) as numbers rather than
    // Long objects; `String` keeps the uint64 values of AdmissionGates.seen exact.
    longs: Number,
    defaults: true, // zero values present (routing.replica 0) rather than undefined
    oneofs: true, // chunk.part says which of `delta` / `final` is set
  });
  const v1 = grpc.loadPackageDefinition(definition).blazar.v1;
  return new v1.Inference(ADDRESS, grpc.credentials.createInsecure());
}

function deadline() {
  return new Date(Date.now() + DEADLINE_MS);
}

// Each call's metadata: the API key, when there is one, as `authorization: Bearer`.
function metadata() {
  const md = new grpc.Metadata();
  if (API_KEY) md.set("authorization", `Bearer ${API_KEY}`);
  return md;
}

function listModels(client) {
  return new Promise((resolve, reject) => {
    client.ListModels({}, metadata(), { deadline: deadline() }, (err, response) =>
      err ? reject(err) : resolve(response.models),
    );
  });
}

// Runs one Chat call; `onDelta` sees every Delta, the promise resolves to the Final.
function chat(client, request, onDelta) {
  return new Promise((resolve, reject) => {
    const call = client.Chat(request, metadata(), { deadline: deadline() });
    let final = null;
    call.on("data", (chunk) => {
      if (chunk.part === "delta") onDelta(chunk.delta);
      else if (chunk.part === "final") final = chunk.final;
    });
    call.on("error", reject);
    call.on("end", () =>
      final ? resolve(final) : reject(new Error("the stream ended without a final chunk")),
    );
  });
}

async function streamChat(client, model) {
  console.log(`\nchat (${model}):`);
  let deltas = 0;
  const final = await chat(
    client,
    {
      model,
      messages: [{ role: "user", content: "Write one sentence about the sea." }],
      sampling: {
        max_tokens: 24,
        temperature: 0.7,
        seed: 42,
        // The bundled model is a small base model that may end its turn at once;
        // this keeps it writing to max_tokens, so that there is always a stream to see.
        ignore_eos: true,
      },
    },
    (delta) => {
      deltas += 1;
      process.stdout.write(delta.text);
    },
  );
  const usage = final.usage || {};
  console.log(
    `\nstreamed ${deltas} deltas, finish ${final.finish_reason}, ` +
      `${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens, ` +
      `lane ${final.model}`,
  );
  if (deltas === 0) throw new Error("the chat streamed no delta");
}

async function forcedToolCall(client, model) {
  console.log(`\nforced tool call (${TOOL.name}):`);
  const calls = []; // by index: {id, name, arguments (JSON text, joined from fragments)}
  const final = await chat(
    client,
    {
      model,
      messages: [{ role: "user", content: "What is the weather in Paris tomorrow?" }],
      tools: [
        {
          name: TOOL.name,
          description: TOOL.description,
          parameters: JSON.stringify(TOOL.parameters), // the schema travels as JSON text
        },
      ],
      tool_choice: { mode: "MODE_NAMED", name: TOOL.name },
      parallel_tool_calls: false,
      // The call is forced by a grammar, which ends the output; this is only an upper
      // bound (the longest call this schema allows is well under it).
      sampling: { max_tokens: 512, seed: 7 },
    },
    (delta) => {
      for (const part of delta.tool_calls) {
        const call = (calls[part.index] ||= { id: "", name: "", arguments: "" });
        call.id += part.id;
        call.name += part.name;
        call.arguments += part.arguments;
      }
    },
  );
  if (final.finish_reason !== "FINISH_REASON_TOOL_CALLS") {
    throw new Error(`expected a tool call, the turn ended with ${final.finish_reason}`);
  }
  // Only the first `final.tool_calls` calls are whole (see Final.tool_calls).
  const whole = calls.slice(0, final.tool_calls);
  if (whole.length !== 1) throw new Error(`expected one whole call, got ${whole.length}`);
  const [call] = whole;
  const args = JSON.parse(call.arguments); // throws, so exits 1, if it is not JSON
  console.log(`tool call: ${call.name} ${JSON.stringify(args)}`);
  console.log(`call id: ${call.id}`);
}

async function main() {
  const client = loadInference();
  try {
    const models = await listModels(client);
    console.log(`models at ${ADDRESS}:`);
    for (const m of models) {
      console.log(`  ${m.id}  (lane ${m.lane}, ${m.ready ? "ready" : "not ready"})`);
    }
    const model = process.env.BLAZAR_MODEL || (models.find((m) => m.ready) || {}).id;
    if (!model) throw new Error("no model is ready");
    await streamChat(client, model);
    await forcedToolCall(client, model);
  } finally {
    client.close();
  }
}

// google.rpc.Status and google.rpc.ErrorInfo, the rich error details Blazar sends in
// the `grpc-status-details-bin` trailer. Declared here rather than loaded from
// googleapis' .proto files, which proto/ does not ship.
const RPC = protobuf.Root.fromJSON({
  nested: {
    google: {
      nested: {
        protobuf: {
          nested: {
            Any: {
              fields: {
                type_url: { type: "string", id: 1 },
                value: { type: "bytes", id: 2 },
              },
            },
          },
        },
        rpc: {
          nested: {
            Status: {
              fields: {
                code: { type: "int32", id: 1 },
                message: { type: "string", id: 2 },
                details: { rule: "repeated", type: "google.protobuf.Any", id: 3 },
              },
            },
            ErrorInfo: {
              fields: {
                reason: { type: "string", id: 1 },
                domain: { type: "string", id: 2 },
                metadata: { keyType: "string", type: "string", id: 3 },
              },
            },
          },
        },
      },
    },
  },
});
const STATUS = RPC.lookupType("google.rpc.Status");
const ERROR_INFO = RPC.lookupType("google.rpc.ErrorInfo");

// Blazar's ErrorInfo ({reason, domain, metadata}) in a gRPC error, or null. The reason
// says what went wrong (MODEL_NOT_FOUND, QUEUE_FULL, ...) and the metadata the numbers
// behind it, such as `retry_after_ms` on a RESOURCE_EXHAUSTED refusal.
function errorInfo(err) {
  const [raw] = err.metadata ? err.metadata.get("grpc-status-details-bin") : [];
  if (!raw) return null; // an error from gRPC itself (a deadline, a lost connection)
  for (const any of STATUS.decode(raw).details) {
    if (any.type_url === "type.googleapis.com/google.rpc.ErrorInfo") {
      const info = ERROR_INFO.toObject(ERROR_INFO.decode(any.value), { defaults: true });
      if (info.domain === "blazar.dev") return info;
    }
  }
  return null;
}

main().catch((err) => {
  if (err.code !== undefined && err.metadata) {
    // A gRPC error: a status code, and Blazar's reason with its numbers.
    const info = errorInfo(err);
    const name = grpc.status[err.code] || err.code;
    const numbers = info ? Object.entries(info.metadata).map(([k, v]) => `${k}=${v}`) : [];
    const said = info ? ` (${[info.reason, ...numbers].join("; ")})` : "";
    console.error(`error: gRPC ${name}${said}: ${err.details}`);
  } else {
    console.error(`error: ${err.message || err}`);
  }
  process.exitCode = 1;
});
